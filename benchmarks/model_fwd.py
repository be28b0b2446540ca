"""Forward+backward training throughput: Molt's transformer vs the `transformers` model, same weights.

Measures tokens/s of a cross-entropy forward+backward at batch 8 x 128 (fp32, 2 threads) for ~5M
and ~20M parameter dense Qwen3-style configs, in one run, and prints Molt / transformers ratios:

- `full`: every row is 128 real tokens (both sides do identical work).
- `mixed`: 8 samples of random lengths 16..128. transformers pads them to 8 x 128 (the usual
  HF-collator layout, attention mask on padding); Molt packs them into rows of 128 with per-sample
  positions. Throughput counts real (non-padding) tokens only.

Run: `.venv/bin/python benchmarks/model_fwd.py` (writes benchmarks/results/model_fwd.md).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

from molt.models import from_pretrained
from molt.train.packing import pack

CONFIGS = {
    "5M": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    ),
    "20M": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    ),
}
VOCAB, BATCH, SEQ, ITERS = 512, 8, 128, 12


def timed(fns, iters: int = ITERS) -> list[float]:
    """Median seconds of each of `fns()` after two warm-up calls each, the sides alternating call by call (a burst
    of outside load then falls on both, not on whichever ran in its window)."""
    times = [[] for _ in fns]
    for i in range(iters + 2):
        for fn, side in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            if i >= 2:
                side.append(time.perf_counter() - t0)
    return [statistics.median(side) for side in times]


def hf_step(model, ids, attention_mask, targets) -> float:
    logits = model(input_ids=ids, attention_mask=attention_mask).logits
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return float(loss.detach())


def molt_step(model, batch) -> float:
    logits = model(batch.input_ids, batch.position_ids, doc_ids_bt=batch.doc_ids)
    loss = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=-100)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return float(loss.detach())


def models(arch: dict, tmp: Path):
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, tie_word_embeddings=True, **arch)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float().train()
    hf.save_pretrained(tmp)
    return hf, from_pretrained(tmp).train()


def hf_padded(lengths: list[int], g: torch.Generator):
    ids = torch.randint(0, VOCAB, (len(lengths), SEQ), generator=g)
    mask = (torch.arange(SEQ)[None] < torch.tensor(lengths)[:, None]).long()
    has_next = torch.arange(SEQ)[None] < torch.tensor(lengths)[:, None] - 1  # a sample's last token predicts nothing
    targets = torch.where(has_next, ids.roll(-1, dims=1), -100)
    return ids, mask, targets, [ids[i, :n].tolist() for i, n in enumerate(lengths)]


def bench(name: str, arch: dict) -> list[tuple]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hf, molt = models(arch, Path(tmp))
        params = sum(p.numel() for p in molt.parameters()) / 1e6
        g = torch.Generator().manual_seed(0)
        for layout, lengths in (
            ("full", [SEQ] * BATCH),
            ("mixed", torch.randint(16, SEQ + 1, (BATCH,), generator=g).tolist()),
        ):
            ids, mask, targets, samples = hf_padded(lengths, g)
            (batch,) = pack(samples, [[1] * len(s) for s in samples], row_len=SEQ, micro_batch_tokens=BATCH * SEQ)
            real = sum(lengths)
            steps = partial(hf_step, hf, ids, mask, targets), partial(molt_step, molt, batch)
            losses = [step() for step in steps]  # the same weights and tokens: the same loss (packing included)
            assert abs(losses[0] - losses[1]) <= 1e-4 * abs(losses[0]), (layout, losses)
            t_hf, t_molt = timed(steps)
            rows.append(
                (name, f"{params:.1f}M", layout, batch.input_ids.shape[0], real / t_hf, real / t_molt, t_hf / t_molt)
            )
    return rows


def main() -> None:
    torch.set_num_threads(2)
    table = [
        "| model | params | batch | Molt rows | transformers tok/s | Molt tok/s | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, arch in CONFIGS.items():
        for r in bench(name, arch):
            table.append(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.0f} | {r[5]:.0f} | **{r[6]:.2f}x** |")
            print(table[-1], flush=True)
    header = (
        f"# Forward+backward throughput (fp32, {torch.get_num_threads()} threads, batch {BATCH} x {SEQ})\n\n"
        f"torch {torch.__version__}, transformers {transformers.__version__}, python {sys.version.split()[0]}. "
        "Tokens/s count real tokens; `mixed` = random lengths 16..128, padded for transformers, packed for Molt.\n\n"
    )
    out = Path(__file__).parent / "results" / "model_fwd.md"
    out.write_text(header + "\n".join(table) + "\n")
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
