"""GPU decode benchmark: Molt's engine vs `transformers` generate() in bf16 at the Qwen3-0.6B shape.

One model with random weights (28 layers, hidden 1024, 16 heads, 8 kv heads, head_dim 128, intermediate 3072,
vocab 151936, q/k-norm, tied embeddings), bf16 on one GPU. The same weights go to `transformers`
(`Qwen3ForCausalLM` loaded from Molt's `save_pretrained` folder, bf16, `attn_implementation="sdpa"`). Per batch
(1 / 64 / 256) of random prompts of 128-512 tokens, every request generates exactly `new_tokens` (256) tokens,
sampled at temperature 1 (no top-k / top-p, EOS ignored). Reported per side and batch:

- tok/s: generated tokens over the wall time of the whole batch (prefill included); decode tok/s: rows over
  the mean time of one decode step (Molt: its decode-only steps; transformers: (t(n) - t(1)) / (n - 1) of
  generate() runs of n and 1 new tokens);
- TTFT: Molt, mean over requests of submission -> first token in the timed run; transformers, the wall time
  of generate(max_new_tokens=1) on the batch;
- peak memory: the most GPU memory allocated during the run above what was allocated before it (both models'
  weights stay resident: they are listed once);
- roofline: the bytes a decode step must read from HBM (every weight once, plus each row's keys and values at
  the mean context of the decode phase, prompt + new / 2) over 4.8 TB/s, divided by the measured step time;
- log-prob |diff|: the engine's per-token log-probs of its sampled sequences against the trainer's scoring of
  the same sequences (`molt.train` packing + `token_logprobs`: the model's packed forward, fp32 from the
  logits), mean / p99 / max over all generated tokens of the batch.

transformers runs fewer new tokens when a batch would take longer than `hf_budget_s` (the table says so). Each
measurement is wrapped: a failure prints its traceback, is listed in the report, and the rest goes on.

Molt runs as `molt train` runs it on CUDA: the paged KV cache (blocks for every row's full context) with decode
steps replayed from captured CUDA graphs (`molt/engine/graphs.py`); graph capture is part of its warm-up, not of
the timed run. Run on one GPU (~2 minutes): `python benchmarks/gpu_engine.py [--out DIR] [--eager]`; it writes
`benchmarks/results/gpu_engine.{md,json}` (and the same files into DIR). `--eager` adds the paged engine without
graphs as a third side. `--smoke`: the same code on CPU at a tiny shape in seconds (writes only to `--out` when
given, else `results/gpu_engine_smoke.*`); `tests/engine/test_gpu_engine_bench.py` runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import transformers

from molt.engine import SamplingParams, TorchEngine, paged_attention
from molt.models import PRESETS, Transformer, TransformerConfig, save_pretrained

HBM_BYTES_S = 4.8e12  # H200 HBM3e, the vendor's datasheet
# the Qwen3-0.6B shape (Molt's `qwen3-0.6b` preset) with its real vocabulary
QWEN3_06B = {k: v for k, v in dataclasses.asdict(PRESETS["qwen3-0.6b"]).items() if k != "model_type"}
QWEN3_06B["vocab_size"] = 151936
TINY = dict(
    hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=512
)


@dataclass
class Setup:
    """What one run measures: the model shape, where, and the jobs."""

    shape: dict
    device: str
    batches: tuple[int, ...]
    prompt_lens: tuple[int, int]  # uniform in [lo, hi]
    new_tokens: int
    hf_budget_s: float  # transformers gets fewer new tokens when a batch would take longer
    max_num_batched_tokens: int
    dtype: str = "bfloat16"
    eager: bool = False


FULL = Setup(QWEN3_06B, "cuda", (1, 64, 256), (128, 512), 256, hf_budget_s=15.0, max_num_batched_tokens=8192)
SMOKE = Setup(TINY, "cpu", (1, 4), (8, 24), 8, hf_budget_s=60.0, max_num_batched_tokens=64)


@dataclass
class Report:
    """Rows of the table, what the run was, and every failed measurement."""

    setup: dict
    meta: dict = field(default_factory=dict)
    rows: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def attempt(report: Report, what: str, fn, *args, **kwargs):
    """`fn(*args, **kwargs)`, or None after printing and recording its error (one failure never ends the run)."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - a benchmark reports what it could measure
        traceback.print_exc()
        report.errors.append(f"{what}: {type(e).__name__}: {e}")
        free_memory()
        return None


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def memory_mark(device: str) -> int:
    """Bytes allocated now, peak counter reset (CUDA; 0 elsewhere)."""
    if device != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def peak_gib_since(device: str, mark: int) -> float | None:
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - mark) / 2**30


def build_models(setup: Setup, folder: str):
    """(Molt model, transformers model) with the same random weights, in the setup's dtype and device."""
    dtype = getattr(torch, setup.dtype)
    torch.manual_seed(0)
    cfg = TransformerConfig(model_type="qwen3", **setup.shape)
    with torch.device(setup.device):
        model = Transformer(cfg).init_weights(0.02)
    model = model.to(dtype).eval()
    save_pretrained(model, folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    hf = hf.to(setup.device).eval()
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = None, 0
    return model, hf


def same_function(model, hf, setup: Setup) -> float:
    """Max |log-prob diff| between Molt's and transformers' full forward on one prompt (a weights check)."""
    ids = torch.randint(0, setup.shape["vocab_size"], (1, setup.prompt_lens[0]), device=setup.device)
    with torch.no_grad():
        a = torch.log_softmax(model(ids).float(), -1)
        b = torch.log_softmax(hf(ids).logits.float(), -1)
    return float((a - b).abs().max())


def random_prompts(setup: Setup, batch: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lo, hi = setup.prompt_lens
    lengths = torch.randint(lo, hi + 1, (batch,), generator=g).tolist()
    return [torch.randint(0, setup.shape["vocab_size"], (n,), generator=g).tolist() for n in lengths]


def step_bytes(model: Transformer, batch: int, context: float) -> float:
    """HBM bytes one decode step must read: every weight once, each row's keys and values at `context`."""
    cfg = model.cfg
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    elem = next(model.parameters()).element_size()
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem
    return weights + batch * context * kv_per_token


# ---- Molt ------------------------------------------------------------------------------------------------------
def molt_engine(model, setup: Setup, batch: int, graphs: bool) -> tuple[TorchEngine, float]:
    """A warmed-up engine for `batch` concurrent requests (seconds spent warming up, graph capture included)."""
    max_len = setup.prompt_lens[1] + setup.new_tokens + 1
    budget, blocks = setup.max_num_batched_tokens, batch * -(-max_len // 16)
    engine = TorchEngine(model, num_slots=batch, max_seq_len=max_len, max_num_batched_tokens=budget,
                         prefix_cache=False, eos_token_ids=(), seed=0, kv_blocks=blocks, graphs=graphs)  # fmt: skip
    t0 = time.perf_counter()
    warm = random_prompts(setup, min(batch, 4), seed=99)
    molt_generate(engine, warm, 4)
    return engine, time.perf_counter() - t0


def molt_generate(engine: TorchEngine, prompts: list[list[int]], new_tokens: int):
    """(completions, wall seconds) with every request submitted at once."""
    sampling = SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True)

    async def run():
        return await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))

    t0 = time.perf_counter()
    outs = asyncio.run(run())
    elapsed = time.perf_counter() - t0
    if any(len(o.token_ids) != new_tokens for o in outs):
        raise RuntimeError(f"a request finished early: {sorted({o.finish_reason for o in outs})}")
    return outs, elapsed


def bench_molt(model, setup: Setup, batch: int, graphs: bool, report: Report) -> dict:
    """One timed batch on a fresh engine; log-probs scored against the trainer's forward afterwards."""
    engine, warm_s = molt_engine(model, setup, batch, graphs)
    runner = engine.core.runner
    path = dict(graphs_captured=len(runner.graphs.graphs) if runner.graphs else 0, triton=paged_attention.BACKEND)
    print(f"Molt batch {batch}: warm-up {warm_s:.1f}s, {path}", flush=True)
    prompts = random_prompts(setup, batch, seed=batch)
    try:
        mark = memory_mark(setup.device)
        before = dict(engine.stats)
        outs, wall = molt_generate(engine, prompts, setup.new_tokens)
        peak = peak_gib_since(setup.device, mark)
        stats = {k: engine.stats[k] - before[k] for k in before}
    finally:
        asyncio.run(engine.close())
        del engine
        free_memory()
    step_s = stats["decode_s"] / max(stats["decode_only_steps"], 1)
    row = dict(side="Molt" if graphs else "Molt eager", batch=batch, new_tokens=setup.new_tokens)
    row.update(tok_s=batch * setup.new_tokens / wall, decode_tok_s=batch / step_s, step_ms=1e3 * step_s)
    row.update(ttft_ms=1e3 * statistics.mean(o.metrics["ttft_s"] for o in outs), peak_gib=peak, warmup_s=warm_s)
    row.update(path)
    row["roofline"] = roofline(model, batch, prompts, setup.new_tokens, step_s)
    diff = attempt(report, f"{row['side']} batch {batch}: log-prob diff", logprob_diff, model, prompts, outs)
    row.update(diff or {})
    return row


def roofline(model, batch: int, prompts, new_tokens: int, step_s: float) -> float:
    context = statistics.mean(map(len, prompts)) + new_tokens / 2
    return step_bytes(model, batch, context) / HBM_BYTES_S / step_s


def logprob_diff(model, prompts, outs, micro_batch_tokens: int = 8192) -> dict:
    """|engine log-prob - trainer log-prob| over every generated token: the trainer's packing and scoring."""
    from molt.train.packing import pack, placements
    from molt.train.trainer import token_logprobs

    samples = [p + o.token_ids for p, o in zip(prompts, outs, strict=True)]
    masks = [[0] * len(p) + [1] * len(o.token_ids) for p, o in zip(prompts, outs, strict=True)]
    device = next(model.parameters()).device
    diffs = []
    with torch.no_grad():
        for packed in pack(samples, masks, max(map(len, samples)), micro_batch_tokens):
            logp_rw = token_logprobs(model, packed.to(device), 1.0).cpu()
            for row, col, piece in placements(packed.rows):
                first = col + len(prompts[piece.sample]) - 1
                engine_lp = torch.tensor(outs[piece.sample].logprobs)
                diffs.append((logp_rw[row, first : col + len(piece) - 1] - engine_lp).abs())
            del logp_rw
    diff = torch.cat(diffs).double()
    return dict(lp_mean=float(diff.mean()), lp_p99=float(diff.quantile(0.99)), lp_max=float(diff.max()))


# ---- transformers ----------------------------------------------------------------------------------------------
def hf_generate(hf, prompts: list[list[int]], new_tokens: int, device: str) -> float:
    """Seconds for one left-padded batched generate() of exactly `new_tokens` tokens sampled at T = 1."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :], mask[row, width - len(p) :] = torch.tensor(p), 1
    ids, mask = ids.to(device), mask.to(device)
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens)  # fmt: skip
    sync(device)
    if out.shape[1] != width + new_tokens:
        raise RuntimeError(f"generate() returned {out.shape[1] - width} new tokens, not {new_tokens}")
    return time.perf_counter() - t0


def bench_hf(hf, model, setup: Setup, batch: int) -> dict:
    """TTFT (1 new token), a 9-token probe for the step time, then the full run (fewer tokens over budget)."""
    prompts = random_prompts(setup, batch, seed=batch)
    hf_generate(hf, prompts[:4], 2, setup.device)  # warm-up
    mark = memory_mark(setup.device)
    ttft = hf_generate(hf, prompts, 1, setup.device)
    probe_step = (hf_generate(hf, prompts, 9, setup.device) - ttft) / 8
    new = setup.new_tokens
    if ttft + probe_step * new > setup.hf_budget_s:
        new = max(16, int((setup.hf_budget_s - ttft) / max(probe_step, 1e-9)))
    wall = hf_generate(hf, prompts, new, setup.device)
    peak = peak_gib_since(setup.device, mark)
    step_s = max(wall - ttft, 1e-9) / (new - 1)
    row = dict(side="transformers", batch=batch, new_tokens=new, tok_s=batch * new / wall, decode_tok_s=batch / step_s)
    row.update(step_ms=1e3 * step_s, ttft_ms=1e3 * ttft, peak_gib=peak)
    row["roofline"] = roofline(model, batch, prompts, new, step_s)
    return row


# ---- report ----------------------------------------------------------------------------------------------------
COLUMNS = [
    ("batch", "batch", "{}"),
    ("side", "side", "{}"),
    ("new_tokens", "new tokens", "{}"),
    ("tok_s", "tok/s", "{:.0f}"),
    ("decode_tok_s", "decode tok/s", "{:.0f}"),
    ("vs_hf", "decode / HF", "**{:.2f}x**"),
    ("step_ms", "step ms", "{:.2f}"),
    ("roofline", "HBM roofline", "{:.1%}"),
    ("ttft_ms", "TTFT ms", "{:.1f}"),
    ("peak_gib", "peak GiB", "{:.2f}"),
    ("lp_mean", "lp diff mean", "{:.2e}"),
    ("lp_p99", "lp diff p99", "{:.2e}"),
    ("lp_max", "lp diff max", "{:.2e}"),
]


def table(rows: list[dict]) -> list[str]:
    lines = ["| " + " | ".join(title for _, title, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = [fmt.format(row[key]) if row.get(key) is not None else "n/a" for key, _, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(report: Report) -> str:
    s, m = report.setup, report.meta
    lines = [
        "# GPU engine benchmark" + (" (smoke: tiny shape on CPU)" if m.get("smoke") else ""),
        "",
        f"Generated by `benchmarks/gpu_engine.py` on {m.get('device_name')}, torch {torch.__version__},"
        f" transformers {transformers.__version__}, {s['dtype']}, random weights ({m.get('num_params', 0) / 1e6:.0f}M"
        f" parameters, {m.get('weights_gib', 0):.2f} GiB resident per model); prompts of {s['prompt_lens'][0]}-"
        f"{s['prompt_lens'][1]} random tokens, {s['new_tokens']} new tokens sampled at T = 1 (EOS ignored);"
        f" Molt: `TorchEngine` (max_num_batched_tokens {s['max_num_batched_tokens']}); transformers: `generate()`,"
        f" sdpa, left-padded. Total run {m.get('total_s', 0):.0f} s. Molt vs transformers log-prob max |diff| on one"
        f" prompt (weights check): {m.get('weights_check')}.",
        "",
        *table(report.rows),
        "",
        "decode / HF: the side's decode tok/s over transformers' at the same batch. HBM roofline: the bytes a"
        f" decode step must read (weights once + KV at the decode phase's mean context) over {HBM_BYTES_S / 1e12:.1f}"
        " TB/s, divided by the measured step time. lp diff: engine vs trainer log-prob |diff| over every generated"
        " token of the batch (the trainer's packed forward on the same weights). peak GiB: the most allocated"
        " during the run above what was allocated before it. transformers rows with fewer new tokens ran shorter"
        " to keep the run within budget.",
    ]
    if report.errors:
        lines += ["", "Failed measurements:", "", *(f"- {e}" for e in report.errors)]
    return "\n".join(lines) + "\n"


def write(report: Report, folders: list[Path], name: str) -> None:
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.md").write_text(markdown(report))
        (folder / f"{name}.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
        print(f"wrote {folder / name}.md and .json")


def run(setup: Setup, smoke: bool) -> Report:
    report = Report(setup=asdict(setup), meta=dict(smoke=smoke, python=platform.python_version()))
    t0 = time.perf_counter()
    name = torch.cuda.get_device_name() if setup.device == "cuda" else platform.processor() or platform.machine()
    report.meta["device_name"] = name
    with tempfile.TemporaryDirectory(prefix="molt-gpu-bench-") as folder:
        model, hf = build_models(setup, folder)
    report.meta["num_params"] = model.num_params()
    report.meta["weights_gib"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    report.meta["weights_check"] = attempt(report, "weights check", same_function, model, hf, setup)
    sides = [True, False] if setup.eager else [True]
    for batch in setup.batches:
        hf_row = attempt(report, f"transformers batch {batch}", bench_hf, hf, model, setup, batch)
        for graphs in sides:
            row = attempt(
                report, f"Molt batch {batch} graphs={graphs}", bench_molt, model, setup, batch, graphs, report
            )
            if row is not None:
                row["vs_hf"] = row["decode_tok_s"] / hf_row["decode_tok_s"] if hf_row else None
                report.rows.append(row)
                print(table([row])[-1], flush=True)
        if hf_row is not None:
            hf_row["vs_hf"] = 1.0
            report.rows.append(hf_row)
            print(table([hf_row])[-1], flush=True)
    report.meta["total_s"] = time.perf_counter() - t0
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shape on CPU, in seconds (tests)")
    parser.add_argument("--eager", action="store_true", help="also Molt's paged engine without CUDA graphs")
    parser.add_argument("--out", type=Path, default=None, help="also write the report files into this folder")
    parser.add_argument("--batches", type=str, default=None, help="comma-separated batch sizes (default 1,64,256)")
    args = parser.parse_args(argv)
    setup = SMOKE if args.smoke else FULL
    setup.eager = args.eager
    if args.batches:
        setup.batches = tuple(int(b) for b in args.batches.split(","))
    if setup.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --smoke on CPU")
    print("\n".join(table([])), flush=True)
    report = run(setup, args.smoke)
    name = "gpu_engine_smoke" if args.smoke else "gpu_engine"
    results = Path(__file__).parent / "results"
    folders = [args.out] if args.smoke and args.out else [results, *([args.out] if args.out else [])]
    write(report, folders, name)
    print(markdown(report))


if __name__ == "__main__":
    main()
