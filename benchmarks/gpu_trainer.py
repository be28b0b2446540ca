"""Trainer step at GPU scale: Molt's packed forward + backward + AdamW vs `transformers`, same model, same tokens.

Builds the Qwen3-0.6B shape (28 layers, hidden 1024, vocab 151,936; random weights), fp32 master weights and
bf16 compute (Molt: `Precision` autocast, FlexAttention over packed rows, chunked LM head; transformers: the
same autocast, `attn_implementation="sdpa"`, its own loss on padded unpacked rows). Each case trains on the
same samples:

- `1K rows`, `4K rows`, `16K rows`: 16K tokens per step, rows of that width holding several samples each
  (transformers pads every sample to the longest one);
- `32K sample`: one sample of 32K tokens.

Per case and system: tokens/s (real tokens, not padding), MFU (6 x N x tokens/s over the H200's 989 TFLOP/s
dense bf16 peak; attention FLOPs not counted) and peak memory (parameters, gradients and AdamW states
included). Molt runs with and without activation checkpointing. A failed case (e.g. out of memory) prints its
error and the rest continue. Results: a table on stdout, `benchmarks/results/gpu_trainer.{md,json}` (and
`--out DIR`).

    python benchmarks/gpu_trainer.py            # CUDA, ~2-4 minutes on one H200
    python benchmarks/gpu_trainer.py --smoke    # CPU, tiny shape, seconds (run by tests/train/test_gpu_bench.py)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch

from molt.models import Transformer, preset, save_pretrained
from molt.train.logprobs import token_logprobs
from molt.train.memory import checkpoint_layers
from molt.train.packing import Piece, collate
from molt.train.precision import Precision

PEAK_FLOPS = 989e12  # H200 dense bf16
FULL_CASES = [
    ("1K rows", 1024, 16, 4),
    ("4K rows", 4096, 4, 8),
    ("16K rows", 16384, 1, 16),
    ("32K sample", 32768, 1, 1),
]
SMOKE_CASES = [("64 rows", 64, 4, 3), ("256 row", 256, 1, 4), ("512 sample", 512, 1, 1)]


def model_config(smoke: bool):
    """The Qwen3-0.6B shape with its real vocabulary, or a tiny one for `--smoke`."""
    if smoke:
        return preset("tiny", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, head_dim=16)
    return preset("qwen3-0.6b", vocab_size=151936)


def samples_for(row_tokens: int, rows: int, per_row: int, vocab: int, seed: int = 0):
    """Token lists filling `rows` rows of `row_tokens` exactly, `per_row` random-length samples each."""
    rng = random.Random(seed)
    samples, layout = [], []
    for _ in range(rows):
        cuts = sorted(rng.sample(range(16, row_tokens - 16), per_row - 1)) if per_row > 1 else []
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, row_tokens], strict=True)]
        layout.append([Piece(len(samples) + i, 0, n) for i, n in enumerate(lengths)])
        samples += [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    masks = [[0] * (len(s) // 4) + [1] * (len(s) - len(s) // 4) for s in samples]  # a prompt, then the answer
    return samples, masks, layout


def molt_step(model, opt, batch, precision: Precision):
    """Packed forward (trained positions only, chunked head) + backward + AdamW."""
    with precision.autocast():
        logp = token_logprobs(model, batch, 1.0, trained_only=True)
    loss = -(logp * batch.loss_mask).sum() / batch.loss_mask.sum()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def hf_step(model, opt, ids, attn, labels, precision: Precision):
    """transformers' forward with its own loss on padded rows + backward + AdamW."""
    with precision.autocast():
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def padded(samples, masks, device):
    """transformers' usual layout: one row per sample, right-padded; labels -100 off the answer and on padding."""
    width = max(map(len, samples))
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (s, m) in enumerate(zip(samples, masks, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        labels[i, : len(s)] = torch.where(torch.tensor(m) > 0, torch.tensor(s), -100)
    return ids.to(device), attn.to(device), labels.to(device)


def timed(step, device: str, iters: int) -> tuple[float, float]:
    """(median seconds per step after two warm-up steps, peak memory in GB over the timed steps)."""
    step(), step()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else float("nan")
    return statistics.median(times), peak


def hf_model(model: Transformer, folder: str, device: str):
    import transformers

    save_pretrained(model, folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float32)
    return hf.to(device).train()


def run_case(name, case, systems, device, iters, num_params):
    """One row of the table per system that ran (or failed) on this case."""
    samples, masks, layout = samples_for(*case, vocab=systems["vocab"])
    tokens = sum(map(len, samples))
    batch = collate(samples, masks, layout).to(device)
    ids, attn, labels = padded(samples, masks, device)
    steps = {
        "molt": lambda: molt_step(systems["molt"], systems["molt_opt"], batch, systems["precision"]),
        "molt+AC": lambda: molt_step(systems["molt_ac"], systems["molt_ac_opt"], batch, systems["precision"]),
        "transformers": lambda: hf_step(systems["hf"], systems["hf_opt"], ids, attn, labels, systems["precision"]),
    }
    rows = []
    for system, step in steps.items():
        row = {"case": name, "system": system, "tokens": tokens, "padded_tokens": tokens}
        if system == "transformers":
            row["padded_tokens"] = int(ids.numel())
        try:
            seconds, peak = timed(step, device, iters)
            tok_s = tokens / seconds
            row |= {"tok_s": tok_s, "mfu": 6 * num_params * tok_s / PEAK_FLOPS, "peak_gb": peak, "step_s": seconds}
        except Exception as e:  # noqa: BLE001 - one failure (OOM) must not stop the table
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            traceback.print_exc()
        finally:
            for key in ("molt_opt", "molt_ac_opt", "hf_opt"):
                systems[key].zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def build_systems(smoke: bool, device: str, folder: str) -> dict:
    cfg = model_config(smoke)
    torch.manual_seed(0)
    with torch.device(device):
        molt = Transformer(cfg).init_weights(0.02)
    molt_ac = Transformer(cfg).to(device)
    molt_ac.load_state_dict(molt.state_dict())
    molt_ac.reset_rope()
    checkpoint_layers(molt_ac)
    hf = hf_model(molt, folder, device)
    precision = Precision(torch.bfloat16, torch.float32, device)
    adam = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-5, fused=True)  # noqa: E731
    return dict(molt=molt, molt_ac=molt_ac, hf=hf, precision=precision, vocab=cfg.vocab_size,
                molt_opt=adam(molt), molt_ac_opt=adam(molt_ac), hf_opt=adam(hf))  # fmt: skip


def report(rows, out_dirs, meta) -> str:
    lines = [f"# GPU trainer step: Molt vs transformers ({meta['shape']}, bf16-mixed, {meta['device']})", ""]
    lines += [
        f"N = {meta['params'] / 1e6:.0f}M parameters; MFU = 6 N tokens/s / 989 TFLOP/s; torch {meta['torch']}",
        "",
    ]
    lines += [
        "| case | system | tokens (padded) | tok/s | MFU | peak GB | vs transformers |",
        "|---|---|---|---|---|---|---|",
    ]
    hf = {r["case"]: r.get("tok_s") for r in rows if r["system"] == "transformers"}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['system']} | {r['tokens']} | {r['error']} | | | |")
            continue
        ratio = f"{r['tok_s'] / hf[r['case']]:.2f}x" if hf.get(r["case"]) else "n/a"
        lines.append(
            f"| {r['case']} | {r['system']} | {r['tokens']} ({r['padded_tokens']}) | {r['tok_s']:,.0f} | "
            f"{r['mfu']:.1%} | {r['peak_gb']:.1f} | {ratio} |"
        )
    text = "\n".join(lines) + "\n"
    for d in out_dirs:
        d.mkdir(parents=True, exist_ok=True)
        stem = "gpu_trainer_smoke" if meta["device"] == "cpu" else "gpu_trainer"  # never overwrites a GPU report
        (d / f"{stem}.md").write_text(text)
        (d / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return text


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shape: checks the code path in seconds")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--out", default="", help="also write the report here")
    parser.add_argument("--results", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--cases", default="", help="comma-separated case names to run (default: all)")
    args = parser.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    cases = SMOKE_CASES if args.smoke else FULL_CASES
    if args.cases:
        cases = [c for c in cases if c[0] in args.cases.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        systems = build_systems(args.smoke, device, folder)
        num_params = systems["molt"].num_params()
        gpu = torch.cuda.get_device_name() if device == "cuda" else ""
        meta = {"shape": "tiny" if args.smoke else "Qwen3-0.6B", "device": device, "params": num_params,
                "torch": torch.__version__, "gpu": gpu}  # fmt: skip
        rows = [r for name, *case in cases for r in run_case(name, case, systems, device, args.iters, num_params)]
    out_dirs = [Path(args.results)] + ([Path(args.out)] if args.out else [])
    if args.smoke and args.out:  # a smoke run with --out (tests, gpu_check.sh --dry-run) leaves the repo alone
        out_dirs = [Path(args.out)]
    print(report(rows, out_dirs, meta))


if __name__ == "__main__":
    main()
