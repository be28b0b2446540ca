"""Trainer step at GPU scale: Molt's packed forward + backward + AdamW vs `transformers`, same model, same tokens.

Builds the Qwen3-0.6B shape (28 layers, hidden 1024, vocab 151,936; random weights), fp32 master weights and
bf16 compute (Molt: `Precision` autocast, FlexAttention over packed rows, chunked LM head, optionally regional
`torch.compile` and activation checkpointing; transformers: the same autocast, `attn_implementation="sdpa"`,
its own loss on unpacked rows padded per micro-batch, micro-batches of at most 16K padded tokens accumulated
into one optimizer step). Each case trains on the same samples:

- `16K rows`, `1K rows`, `4K rows`: 16K tokens per step, rows of that width holding several samples each;
- `32K sample`: one sample of 32K tokens.

Every (case, system) builds its own model and fused AdamW from the same CPU weights and frees them after, so the
peak memory is that system's alone. Per row: tokens/s (real tokens, not padding), MFU (6 x N x tokens/s over the
H200's 989 TFLOP/s dense bf16 peak; attention FLOPs not counted), peak memory and its parts: parameters +
AdamW states, gradients, and the rest (activations and temporaries). One warm-up step (compilation happens
there), then `--iters` timed steps; rows print as measured. Rows run most important first and stop at
`--budget-s` (later ones are listed as skipped). A failed row (e.g. out of memory) prints its error and the rest
continue. Results: a table on stdout, `benchmarks/results/gpu_trainer.{md,json}` (and `--out DIR`).

    python benchmarks/gpu_trainer.py            # CUDA, < 2 minutes on one H200
    python benchmarks/gpu_trainer.py --smoke    # CPU, tiny shape, seconds (run by tests/train/test_gpu_bench.py)
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import random
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch

from molt.models import Transformer, preset, save_pretrained
from molt.train.compile import compile_model
from molt.train.logprobs import token_logprobs
from molt.train.memory import checkpoint_layers
from molt.train.packing import Piece, collate
from molt.train.precision import Precision

PEAK_FLOPS = 989e12  # H200 dense bf16
FULL_CASES = {  # name: (row tokens, rows, samples per row)
    "16K rows": (16384, 1, 16),
    "32K sample": (32768, 1, 1),
    "1K rows": (1024, 16, 4),
    "4K rows": (4096, 4, 8),
}
SMOKE_CASES = {"64 rows": (64, 4, 3), "128 sample": (128, 1, 1)}
SYSTEMS = ("molt+compile", "transformers", "molt+compile+AC", "molt", "molt+AC")
GB = 1e9


def model_config(smoke: bool):
    """The Qwen3-0.6B shape with its real vocabulary, or a tiny one for `--smoke`."""
    if smoke:
        return preset("tiny", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, head_dim=16)
    return preset("qwen3-0.6b", vocab_size=151936)


def plan(cases: dict, systems: tuple[str, ...]) -> list[tuple[str, str]]:
    """(case, system) pairs, most telling first: every system on the first case, then case by case; the eager
    activation-checkpointed rows last (they only show what compile adds to checkpointing)."""
    pairs = [(c, s) for c in cases for s in systems if s != "molt+AC"]
    return pairs + [(c, "molt+AC") for c in cases if "molt+AC" in systems]


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


def molt_step(model, opt, batch, precision: Precision) -> None:
    """Packed forward (trained positions only, chunked head) + backward + AdamW."""
    with precision.autocast():
        logp = token_logprobs(model, batch, 1.0, trained_only=True)
    loss = -(logp * batch.loss_mask).sum() / batch.loss_mask.sum()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def hf_step(model, opt, micro_batches, precision: Precision) -> None:
    """transformers' forward with its own loss per padded micro-batch (weighted by its share of the trained
    tokens: the step's token mean) + backward, then one AdamW step."""
    total = sum(int((labels[:, 1:] != -100).sum()) for _, _, labels in micro_batches)
    for ids, attn, labels in micro_batches:
        with precision.autocast():
            loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        (loss * int((labels[:, 1:] != -100).sum()) / total).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def padded_micro_batches(samples, masks, device, max_tokens: int):
    """transformers' usual layout: one row per sample, longest first, grouped into micro-batches of at most
    `max_tokens` padded tokens (a longer sample is a micro-batch alone), each right-padded to its longest row;
    labels -100 off the answer and on padding."""
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i]))
    groups: list[list[int]] = []
    for i in order:  # longest first: a group's width is its first sample's length
        if groups and (len(groups[-1]) + 1) * len(samples[groups[-1][0]]) <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    out = []
    for group in groups:
        width = len(samples[group[0]])
        ids = torch.zeros(len(group), width, dtype=torch.long)
        attn = torch.zeros_like(ids)
        labels = torch.full_like(ids, -100)
        for row, i in enumerate(group):
            s, m = torch.tensor(samples[i]), torch.tensor(masks[i])
            ids[row, : len(s)], attn[row, : len(s)] = s, 1
            labels[row, : len(s)] = torch.where(m > 0, s, -100)
        out.append((ids.to(device), attn.to(device), labels.to(device)))
    return out


def timed(step, device: str, iters: int) -> dict:
    """One warm-up step (compiles), then `iters` timed ones: median seconds per step, peak memory and its parts."""
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    step()
    sync()
    out = {"warmup_s": time.perf_counter() - t0}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        out["static_gb"] = torch.cuda.memory_allocated() / GB  # parameters + AdamW states (gradients are None)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    out["step_s"] = statistics.median(times)
    out["peak_gb"] = torch.cuda.max_memory_allocated() / GB if cuda else float("nan")
    return out


def memory_parts(row: dict, model) -> None:
    """Split the peak into parameters + optimizer states, gradients (fp32, one per parameter) and the rest."""
    params_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / GB
    if "static_gb" in row:
        row["params_gb"] = params_gb
        row["opt_gb"] = row["static_gb"] - params_gb
        row["grads_gb"] = params_gb
        row["activations_gb"] = row["peak_gb"] - row["static_gb"] - params_gb


def build(system: str, sources: dict, device: str, dynamic: bool):
    """A fresh copy of the weights as `system` runs them, and its fused AdamW."""
    if system == "transformers":
        model = copy.deepcopy(sources["hf"]).to(device).train()
    else:
        model = copy.deepcopy(sources["molt"]).to(device)
        model.reset_rope()
        if system.endswith("AC"):
            checkpoint_layers(model)
        if "compile" in system:  # on CPU (`--smoke`) dynamo alone: the code path, not inductor's minutes
            compile_model(model, "inductor" if device == "cuda" else "eager", dynamic)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    return model, opt


def run_pair(case: str, system: str, data: dict, sources: dict, args, num_params: int) -> dict:
    """One row of the table: `system` trained on `case`'s samples (or its error)."""
    samples, masks, batch, micro = data[case]
    tokens = sum(map(len, samples))
    row = {"case": case, "system": system, "tokens": tokens, "padded_tokens": batch.input_ids.numel()}
    if system == "transformers":
        row["padded_tokens"] = sum(ids.numel() for ids, _, _ in micro)
        row["micro_batches"] = len(micro)
    model = opt = None
    try:
        model, opt = build(system, sources, args.device, not args.static)
        if system == "transformers":
            step = functools.partial(hf_step, model, opt, micro, sources["precision"])
        else:
            step = functools.partial(molt_step, model, opt, batch, sources["precision"])
        row |= timed(step, args.device, args.iters)
        del step
        row |= {"tok_s": tokens / row["step_s"], "mfu": 6 * num_params * tokens / row["step_s"] / PEAK_FLOPS}
        memory_parts(row, model)
    except Exception as e:  # noqa: BLE001 - one failure (OOM) must not stop the table
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        traceback.print_exc()
    finally:
        del model, opt
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return row


def report(rows, out_dirs, meta) -> str:
    """The markdown table (one line per row, grouped by case) and the json, written to each of `out_dirs`."""
    lines = [f"# GPU trainer step: Molt vs transformers ({meta['shape']}, bf16-mixed, {meta['device']} {meta['gpu']})"]
    lines += [
        "",
        f"N = {meta['params'] / 1e6:.0f}M parameters; MFU = 6 N tokens/s / 989 TFLOP/s; torch {meta['torch']}; "
        f"{meta['iters']} timed steps after 1 warm-up; wall {meta['wall_s']:.0f} s",
        "",
        "| case | system | tokens (padded) | tok/s | MFU | peak GB | params+opt / grads / act. GB | warm-up s "
        "| vs transformers |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    hf = {r["case"]: r.get("tok_s") for r in rows if r["system"] == "transformers"}
    for case in dict.fromkeys(r["case"] for r in rows):
        for r in (r for r in rows if r["case"] == case):
            head = f"| {r['case']} | {r['system']} | {r['tokens']} ({r['padded_tokens']}) |"
            if "error" in r or "skipped" in r:
                lines.append(f"{head} {r.get('error') or r['skipped']} | | | | | |")
                continue
            ratio = f"{r['tok_s'] / hf[r['case']]:.2f}x" if hf.get(r["case"]) else "n/a"
            parts = (
                f"{r['params_gb'] + r['opt_gb']:.1f} / {r['grads_gb']:.1f} / {r['activations_gb']:.1f}"
                if "params_gb" in r
                else ""
            )
            lines.append(
                f"{head} {r['tok_s']:,.0f} | {r['mfu']:.1%} | {r['peak_gb']:.1f} | {parts} | {r['warmup_s']:.1f} "
                f"| {ratio} |"
            )
    text = "\n".join(lines) + "\n"
    for d in out_dirs:
        d.mkdir(parents=True, exist_ok=True)
        stem = "gpu_trainer_smoke" if meta["device"] == "cpu" else "gpu_trainer"  # never overwrites a GPU report
        (d / f"{stem}.md").write_text(text)
        (d / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return text


def prepare(args, folder: str) -> tuple[dict, dict, int]:
    """The CPU master weights (Molt and transformers), the precision, and each case's samples and batches."""
    import transformers

    cfg = model_config(args.smoke)
    torch.manual_seed(0)
    molt = Transformer(cfg).init_weights(0.02)
    save_pretrained(molt, folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float32)
    sources = {"molt": molt, "hf": hf, "precision": Precision(torch.bfloat16, torch.float32, args.device)}
    cases = SMOKE_CASES if args.smoke else FULL_CASES
    names = args.cases.split(",") if args.cases else list(cases)
    data = {}
    for name in names:
        samples, masks, layout = samples_for(*cases[name], vocab=cfg.vocab_size)
        micro = padded_micro_batches(samples, masks, args.device, args.hf_micro_tokens)
        data[name] = (samples, masks, collate(samples, masks, layout).to(args.device), micro)
    return data, sources, molt.num_params()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shape: checks the code path in seconds")
    parser.add_argument("--iters", type=int, default=3, help="timed steps per row, after one warm-up step")
    parser.add_argument("--out", default="", help="also write the report here")
    parser.add_argument("--results", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--cases", default="", help="comma-separated case names to run (default: all)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--budget-s", type=float, default=105.0,
                        help="skip a row that would end past this many seconds, guessed from the system's last row "
                        "(45 s for a first compiled one); 0: no budget (--smoke: none)")  # fmt: skip
    parser.add_argument("--hf-micro-tokens", type=int, default=16384, help="transformers' padded micro-batch size")
    parser.add_argument("--static", action="store_true", help="compile for static shapes (default: dynamic)")
    args = parser.parse_args(argv)
    args.device = "cpu" if args.smoke else "cuda"
    args.budget_s = 0.0 if args.smoke else args.budget_s
    t_start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        data, sources, num_params = prepare(args, folder)
        last: dict[str, float] = {}  # per system: its last row's seconds (the first one includes compiling)
        for case, system in plan(data, tuple(s for s in SYSTEMS if s in args.systems.split(","))):
            guess = last.get(system, 45.0 if "compile" in system else 10.0)
            if args.budget_s and time.perf_counter() - t_start + guess > args.budget_s:
                row = {"case": case, "system": system, "tokens": sum(map(len, data[case][0])), "padded_tokens": 0}
                row["skipped"] = f"skipped: past the {args.budget_s:.0f} s budget"
            else:
                t_row = time.perf_counter()
                row = run_pair(case, system, data, sources, args, num_params)
                last[system] = time.perf_counter() - t_row
            print(json.dumps(row), flush=True)
            rows.append(row)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else ""
    meta = {"shape": "tiny" if args.smoke else "Qwen3-0.6B", "device": args.device, "params": num_params,
            "torch": torch.__version__, "gpu": gpu, "iters": args.iters,
            "wall_s": time.perf_counter() - t_start}  # fmt: skip
    out_dirs = [Path(args.results)] + ([Path(args.out)] if args.out else [])
    if args.smoke and args.out:  # a smoke run with --out (tests, gpu_check.sh --dry-run) leaves the repo alone
        out_dirs = [Path(args.out)]
    print(report(rows, out_dirs, meta), flush=True)


if __name__ == "__main__":
    main()
