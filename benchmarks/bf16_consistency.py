"""Engine vs trainer log-prob agreement in low precision (bf16, fp16) on CPU: |diff| mean / p99 / max.

The engine holds a low-precision copy of the trainer's fp32 master weights and samples completions (T = 1,
continuous batching with chunked prefill); the trainer then scores the same tokens with its own packing and
`token_logprobs` in two ways:

- `mixed`: the trainer's default precision on CUDA, fp32 master parameters under `Precision.autocast()`;
- `pure`: the low-precision copy itself (`train.precision pure`, or FSDP2's mixed-precision policy, which casts
  the parameters before the forward).

Baseline in the same run: `fp32 ref`, the engine's tokens scored by the fp32 master without autocast: the
distance of the low-precision function from the fp32 one (what rounding alone costs); and the fp32 engine
against the fp32 trainer (the contract: ~1e-6). Engine paths: `eager` (slot cache), `paged` (block tables,
SDPA over gathered blocks) and `compiled` (decode steps through `torch.compile`, with `--compile`).

Shapes: `refs` (the engine tests' tiny Qwen3: hidden 48, 2 layers, random std-0.2 weights) and `tiny` (the
tiny preset: hidden 256, 4 layers, vocab 512, weights scaled for logits of a few units).

Run: `.venv/bin/python benchmarks/bf16_consistency.py [--compile] [--out NAME]` (writes
benchmarks/results/NAME, default bf16_consistency.md).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import sys
import time
from pathlib import Path

import torch

from molt.engine import SamplingParams, TorchEngine
from molt.models import Transformer, TransformerConfig, preset
from molt.train.packing import pack, placements
from molt.train.precision import Precision
from molt.train.trainer import token_logprobs

SHAPES = {
    "refs": dict(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=12,
        tie_word_embeddings=False,
    ),  # fmt: skip
    "tiny": dict(vocab_size=512, tie_word_embeddings=False),
}
PROMPT_LENS, NEW_TOKENS, SAMPLES = (5, 23, 40, 9, 17, 31), 24, 2


def master_model(shape: str, seed: int = 0) -> Transformer:
    """fp32 random weights with logits of a few units: matrices std 0.2 at hidden 48 (as the engine tests),
    std 1/sqrt(hidden) otherwise with a 3x LM head; norm weights 1 +- 0.1 (not all ones: rounding them matters)."""
    cfg = TransformerConfig(model_type="qwen3", **SHAPES[shape]) if shape == "refs" else preset(shape, **SHAPES[shape])
    model = Transformer(cfg)
    gen = torch.Generator().manual_seed(seed)
    std = 0.2 if shape == "refs" else cfg.hidden_size**-0.5
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(
                    std * torch.randn(p.shape, generator=gen) * (3.0 if "lm_head" in name and shape != "refs" else 1)
                )
    return model.eval()


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def generate(model: Transformer, path: str, ps: list[list[int]]):
    """(prompt, completion) pairs sampled by an engine on `model` (its dtype) along `path`."""
    kwargs = dict(num_slots=4, max_seq_len=96, max_num_batched_tokens=24, eos_token_ids=(), seed=0)
    if path == "paged":
        kwargs.update(kv_blocks=64, block_size=16)
    engine = TorchEngine(model, compile=path == "compiled", **kwargs)
    engine.core.runner.warm_up() if path == "compiled" else None
    sampling = SamplingParams(n=SAMPLES, temperature=1.0, max_tokens=NEW_TOKENS, seed=3)

    async def run():
        return await asyncio.gather(*[engine.generate_group(p, sampling) for p in ps])

    groups = asyncio.run(run())
    asyncio.run(engine.close())
    return [(p, c) for p, group in zip(ps, groups, strict=True) for c in group]


def scored(model: Transformer, pairs, precision: Precision) -> torch.Tensor:
    """The trainer's log-probs of every completion token (its packing, `token_logprobs`, under `precision`)."""
    samples = [p + c.token_ids for p, c in pairs]
    masks = [[0] * len(p) + [1] * len(c.token_ids) for p, c in pairs]
    out: list[torch.Tensor | None] = [None] * len(samples)
    with torch.no_grad():
        for batch in pack(samples, masks, max(map(len, samples)), 4096):
            with precision.autocast():
                logp_rw = token_logprobs(model, batch, 1.0)
            for row, col, piece in placements(batch.rows):
                first = col + len(pairs[piece.sample][0]) - 1
                out[piece.sample] = logp_rw[row, first : col + len(piece) - 1]
    return torch.cat(out)


def stats(diff: torch.Tensor) -> str:
    diff = diff.abs().double()
    return f"{float(diff.mean()):.2e} | {float(diff.quantile(0.99)):.2e} | {float(diff.max()):.2e}"


def measure(shape: str, dtype: torch.dtype, path: str) -> list[str]:
    """Table rows for one shape, dtype and engine path."""
    master = master_model(shape)
    low = copy.deepcopy(master).to(dtype)
    t0 = time.perf_counter()
    pairs = generate(copy.deepcopy(low), path, prompts(master.cfg.vocab_size))
    engine_lp = torch.cat([torch.tensor(c.logprobs) for _, c in pairs])
    refs = {
        "mixed": scored(master, pairs, Precision(dtype, torch.float32, "cpu")),
        "pure": scored(low, pairs, Precision(dtype, dtype, "cpu")),
        "fp32 ref": scored(master, pairs, Precision()),
    }
    name = str(dtype).removeprefix("torch.")
    rows = [f"| {shape} | {name} | {path} | {ref} | {stats(engine_lp - lp)} |" for ref, lp in refs.items()]
    rows.append(f"| {shape} | {name} | {path} | mixed vs pure (no engine) | {stats(refs['mixed'] - refs['pure'])} |")
    print("\n".join(rows), f"({time.perf_counter() - t0:.0f}s)", flush=True)
    return rows


def fp32_rows(shape: str, path: str) -> list[str]:
    master = master_model(shape)
    pairs = generate(copy.deepcopy(master), path, prompts(master.cfg.vocab_size))
    engine_lp = torch.cat([torch.tensor(c.logprobs) for _, c in pairs])
    row = f"| {shape} | float32 | {path} | fp32 trainer | {stats(engine_lp - scored(master, pairs, Precision()))} |"
    print(row, flush=True)
    return [row]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compile", action="store_true", help="also the compiled decode path (slow to compile)")
    parser.add_argument("--shapes", default="refs,tiny")
    parser.add_argument("--out", default="bf16_consistency.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    paths = ["eager", "paged"] + (["compiled"] if args.compile else [])
    header = ["| shape | dtype | engine path | trainer scoring | mean | p99 | max |", "|---|---|---|---|---|---|---|"]
    rows: list[str] = []
    for shape in args.shapes.split(","):
        rows += fp32_rows(shape, "eager")
        for dtype in (torch.bfloat16, torch.float16):
            for path in paths:
                rows += measure(shape, dtype, path)
    title = f"# Engine vs trainer log-prob |diff| in low precision (CPU, torch {torch.__version__})\n\n"
    text = title + __doc__.split("\n\n", 1)[1].split("\nRun:")[0] + "\n" + "\n".join(header + rows) + "\n"
    out = Path(__file__).parent / "results" / args.out
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
