"""Host time per decode step of the paged engine's graphed path, with the model's forward stubbed out.

On a GPU a decode step of the Qwen3-0.6B shape at batch 256 is ~1.5-2 ms of device work; whatever Python the
step runs around the graph replay adds to that unless it is hidden. This measures that Python on the CPU: an
`EngineCore` with the paged KV cache and `GraphDecode` (the same static buffers as on CUDA, run without capture)
whose replay is replaced by a preallocated logits buffer of the right shape, so a step's time is everything but
the model: scheduling and block reservation, block tables and the step's input buffers, sampling and log-probs
(over a small vocabulary, so that the ops' dispatch, not their arithmetic, is timed: on a GPU the arithmetic is
device work), and the appending / stopping / finishing of results. Prompts of 128-512 random tokens, 256 new
tokens sampled at T = 1 (EOS ignored), every request submitted at once, as `benchmarks/gpu_engine.py` runs it;
only decode-only steps are timed, in CPU time of the engine's thread (a 2-core machine shared with other jobs
deschedules it for whole milliseconds; host work is one thread's CPU time anyway): medians over every such step
of `--repeats` runs, and the 10th percentile of the step total.

Breakdown of a step: scheduler (`schedule()`), inputs (from the plan to the logits: the core's per-row
bookkeeping, block tables, the input buffers, the stubbed replay), sampling (row parameters, the sampling ops and
the one copy of ids and log-probs), dispatch (appending tokens, stop checks, finishing, callbacks).

Run: `.venv/bin/python benchmarks/engine_host.py [--label TEXT]`; prints the table and appends it, with the git
revision, to `benchmarks/results/engine_host.md`. To compare with another revision on a noisy machine, export
its `molt/` (`git archive REV molt | tar -x -C DIR`) and run this script with `PYTHONPATH=DIR`, alternating.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

import molt
import molt.engine.core as core_mod
from molt.engine.core import EngineCore
from molt.engine.interface import SamplingParams
from molt.engine.sampling import sample_seed
from molt.engine.scheduler import Group
from molt.models import Transformer, TransformerConfig

PHASES = ("scheduler", "inputs", "sampling", "dispatch")
VOCAB, BLOCK, PROMPTS, NEW_TOKENS = 32, 16, (128, 512), 256
TINY = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
MARKS: dict[str, float] = {}  # when this step's schedule, forward and sampling returned
CLOCK = time.thread_time  # CPU seconds of this thread: on a shared machine, time spent descheduled is not counted


def build_core(batch: int) -> EngineCore:
    """A paged engine core for `batch` requests (blocks for every row's full context), graphs without capture."""
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(model_type="qwen3", vocab_size=VOCAB, **TINY)).init_weights(0.02).eval()
    max_len = PROMPTS[1] + NEW_TOKENS + 1
    return EngineCore(
        model,
        num_slots=batch,
        max_seq_len=max_len,
        max_num_batched_tokens=8192,
        prefix_cache=False,
        eos_token_ids=(),
        kv_blocks=batch * -(-max_len // BLOCK),
        block_size=BLOCK,
        graphs=True,
    )


def instrument(core: EngineCore) -> None:
    """Stub the replay and record when the schedule, the forward and the sampling of a step return."""
    graphs = core.runner.graphs
    logits = torch.randn(graphs.buckets[-1], VOCAB)
    graphs._run = lambda bucket: logits[:bucket]  # the graph's work (unpacking the buffers included) is device work
    scheduler, forward = core.scheduler, core.runner.forward

    def schedule(*args, **kwargs):
        plan = type(scheduler).schedule(scheduler, *args, **kwargs)
        MARKS["scheduler"] = CLOCK()
        return plan

    def timed_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        MARKS["inputs"] = CLOCK()
        return out

    scheduler.schedule, core.runner.forward = schedule, timed_forward


def timed_sample(sample):
    """`sampling.sample` as the core calls it, marking when it returns."""

    def wrapped(*args, **kwargs):
        out = sample(*args, **kwargs)
        MARKS["sampling"] = CLOCK()
        return out

    return wrapped


def run_once(batch: int, seed: int) -> list[dict[str, float]]:
    """Per decode-only step of one generation of `batch` requests: seconds of each phase."""
    core = build_core(batch)
    instrument(core)
    g = torch.Generator().manual_seed(seed)
    sampling = SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i in range(batch):
        n = int(torch.randint(PROMPTS[0], PROMPTS[1] + 1, (1,), generator=g))
        prompt = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        core.add(Group(f"r{i}", prompt, sampling, [sample_seed(seed, i)], lambda result: None))
    steps = []
    while core.scheduler.has_work(True):
        MARKS.clear()
        t0 = CLOCK()
        decode_only = core.step()
        end = CLOCK()
        if decode_only and len(MARKS) == 3:
            bounds = [t0, MARKS["scheduler"], MARKS["inputs"], MARKS["sampling"], end]
            steps.append({p: b - a for p, a, b in zip(PHASES, bounds[:-1], bounds[1:], strict=True)})
    if core.num_pending:
        raise RuntimeError(f"{core.num_pending} samples left unfinished")
    return steps


def measure(batch: int, repeats: int) -> dict[str, float]:
    """Median milliseconds per decode-only step, in total and per phase, over `repeats` runs."""
    steps = [s for r in range(repeats) for s in run_once(batch, seed=r)]
    row = {p: 1e3 * statistics.median(s[p] for s in steps) for p in PHASES}
    totals = sorted(sum(s.values()) for s in steps)
    row["total"], row["p10"] = 1e3 * statistics.median(totals), 1e3 * totals[len(totals) // 10]
    row["steps"] = len(steps)
    return row


def revision() -> str:
    root = Path(molt.__file__).resolve().parents[1]
    git = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True).stdout.strip()  # noqa: E731
    rev = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no", "molt")
    return f"{rev}{' + uncommitted changes to molt/' if dirty else ''} ({root})"


def table(rows: dict[int, dict[str, float]]) -> str:
    head = "| batch | host ms/step | p10 | scheduler | inputs | sampling | dispatch | steps timed |"
    lines = [head, "|---" * 8 + "|"]
    for batch, r in rows.items():
        cells = [f"{r[k]:.3f}" for k in ("total", "p10", *PHASES)]
        lines.append(f"| {batch} | **{cells[0]}** | {' | '.join(cells[1:])} | {r['steps']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--label", default="", help="a name for this run in the report")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "engine_host.md"))
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the step's host work is one thread's
    core_mod.sample = timed_sample(core_mod.sample)
    rows = {}
    for batch in args.batches:
        rows[batch] = measure(batch, args.repeats)
        print(f"batch {batch}: {rows[batch]['total']:.3f} ms/step", flush=True)
    where = f"{platform.machine()}, torch {torch.__version__}, Python {platform.python_version()}, 1 thread"
    head = f"## {args.label or 'run'}: {revision()}\n\n{where}; {time.strftime('%Y-%m-%d %H:%M')}\n\n"
    text = head + table(rows) + "\n"
    print(text)
    if not args.no_write:
        with open(args.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
