"""VLM throughput: image prompts vs text-only prompts of the same token count, same `tiny-vlm` model.

1. Prefill: the built-in engine prefills 32 prompts of the `shape_colour` task (16 image tokens +
   text each; one generated token) with their images, vs the same prompts with every image
   placeholder replaced by a text token (no vision tower). Reports prompt tokens/s and image tokens/s.
2. End to end: `molt train` steps (rollout + train, no warm start, no eval) on the `shape_colour`
   task, vs the same task whose image is replaced by a 16-character text description (same prompt
   token count). Reports samples/s.

Run: `.venv/bin/python benchmarks/vlm.py` (writes benchmarks/results/vlm.md). Prints the load average:
on a shared machine the absolute numbers are noisy; the ratios are measured in the same run.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from molt.cli.main import parse_config
from molt.cli.train import run_train
from molt.data.tasks import get_task
from molt.engine import SamplingParams, TorchEngine
from molt.models import Transformer, apply_chat_template, preset
from molt.models.tokenizer import IMAGE_PLACEHOLDER, build_builtin_tokenizer
from molt.models.vision import expand_image_tokens, message_images, to_pixels

BATCH, REPEATS, STEPS = 32, 6, 4


def prefill_rates(model, tokenizer, rows) -> dict[str, float]:
    """Best-of-REPEATS prompt tokens/s of one batch of prompts, with images and as text-only prompts."""
    cfg = model.cfg
    prompts, images = [], []
    for row in rows:
        ids = apply_chat_template(tokenizer, row["messages"], add_generation_prompt=True)
        ids, _ = expand_image_tokens(ids, cfg.image_token_id, cfg.vision.tokens_per_image)
        prompts.append(ids)
        images.append([to_pixels(im, cfg.vision.image_size) for im in message_images(row["messages"])])
    text_prompts = [[ord("x") if t == cfg.image_token_id else t for t in p] for p in prompts]
    one = SamplingParams(temperature=0, max_tokens=1)

    async def batch(engine, ps, ims) -> float:
        t0 = time.perf_counter()
        kws = [{"images": i} if i else {} for i in ims]
        await asyncio.gather(*(engine.generate(p, one, **kw) for p, kw in zip(ps, kws, strict=True)))
        return time.perf_counter() - t0

    arms = {"image": (prompts, images), "text": (text_prompts, [None] * len(prompts))}
    engines = {name: TorchEngine(model, num_slots=BATCH, max_seq_len=128, prefix_cache=False, num_threads=1)
               for name in arms}  # fmt: skip
    best = dict.fromkeys(arms, float("inf"))
    for _ in range(REPEATS):  # arms interleaved, so load changes on the shared machine hit both
        for name, (ps, ims) in arms.items():
            best[name] = min(best[name], asyncio.run(batch(engines[name], ps, ims)))
    for engine in engines.values():
        asyncio.run(engine.close())
    out = {name: sum(map(len, ps)) / best[name] for name, (ps, _) in arms.items()}
    num_image_tokens = sum(t == cfg.image_token_id for p in prompts for t in p)
    out["image_tokens_per_s"] = num_image_tokens / (sum(map(len, prompts)) / out["image"])
    out["image_share"] = num_image_tokens / sum(map(len, prompts))
    return out


def text_rows(rows) -> list[dict]:
    """The rows with each image replaced by a 16-character description (16 tokens, like the image)."""
    out = []
    for row in rows:
        text = f"[{row['label']:^14}]Colour?"
        out.append({"messages": [{"role": "user", "content": text}], "label": row["label"]})
    return out


def end_to_end(folder: Path, rows) -> dict[str, float]:
    """Samples/s of STEPS `molt train` steps on image rows vs text rows (jsonl files, same task grader)."""
    out = dict.fromkeys(["image", "text"], 0.0)
    for run in range(2):  # arms interleaved; best of two runs each
        for name, data in [("image", rows), ("text", text_rows(rows))]:
            path = folder / f"{name}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in data))
            args = ["--data.task", "shape_colour", "--data.path", str(path), "--model.preset", "tiny-vlm"]
            args += ["--model.warmstart_steps", "0", "--train.max_steps", str(STEPS), "--train.warmup_steps", "1"]
            args += ["--eval.every", "0", "--rollout.filters", "nonfinite", "--rollout.max_tokens", "8"]
            args += ["--log.run_dir", str(folder / f"{name}{run}"), "--log.every", "100"]
            args += ["--runtime.threads", "1", "--runtime.engine_threads", "1"]
            result = run_train(parse_config(args))
            samples = sum(m["train/num_samples"] for m in result.history)
            out[name] = max(out[name], samples / result.seconds)
    return out


def main() -> None:
    torch.set_num_threads(1)  # on 2 shared cores, one OpenMP pool per thread avoids wake-up stalls
    load0 = os.getloadavg()[0]
    tokenizer = build_builtin_tokenizer(image_token=True)
    arch = preset("tiny-vlm", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    arch.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER)
    model = Transformer(arch).init_weights(0.02, torch.Generator().manual_seed(0)).eval()
    rows = get_task("shape_colour").rows(400, seed=0)
    prefill = prefill_rates(model, tokenizer, rows[:BATCH])
    with tempfile.TemporaryDirectory() as tmp:
        e2e = end_to_end(Path(tmp), rows)
    load1 = os.getloadavg()[0]
    lines = [
        "# VLM benchmark",
        "",
        f"Generated by `benchmarks/vlm.py` on {platform.machine()}, torch {torch.__version__}, 1 intra-op thread per "
        f"torch thread (engine, trainer), fp32, "
        f"`tiny-vlm` ({model.num_params() / 1e6:.2f}M params, 16 image tokens per 32x32 image).",
        f"Load average (1 min) at the start / end: {load0:.2f} / {load1:.2f} (2 cores; above ~0 means shared, noisy).",
        "",
        "| measure | with images | text-only, same token count | images / text |",
        "|---|---|---|---|",
        f"| prefill prompt tokens/s (batch {BATCH}, {prefill['image_share']:.0%} image tokens) | "
        f"{prefill['image']:.0f} | {prefill['text']:.0f} | **{prefill['image'] / prefill['text']:.2f}x** |",
        f"| prefill image tokens/s | {prefill['image_tokens_per_s']:.0f} | | |",
        f"| `shape_colour` end-to-end samples/s ({STEPS} RL steps x 64 samples) | "
        f"{e2e['image']:.1f} | {e2e['text']:.1f} | **{e2e['image'] / e2e['text']:.2f}x** |",
        "",
        f"Prefill: best of {REPEATS} batches (arms interleaved) on the built-in engine, one generated token "
        "each; the text-only prompts are the same ids with each image placeholder replaced by a byte token "
        "(no vision tower, no scatter). End to end: best of 2 interleaved `molt train` runs, wall time (rollout "
        "+ train, no warm start, no eval) over trained samples; the text-only task describes the colour in 16 "
        "characters instead of showing it.",
    ]
    report = "\n".join(lines) + "\n"
    out = Path(__file__).parent / "results" / "vlm.md"
    out.write_text(report)
    print(report)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
