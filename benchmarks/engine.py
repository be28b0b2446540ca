"""Decode throughput and time-to-first-token: Molt's engine vs `transformers` generate() (and vLLM if present).

For ~5M and ~20M parameter Qwen3-style models (same weights on every side, fp32, 2 threads),
batches of 1, 8, 32 and 128 random prompts of 16-64 tokens each generate exactly 64 new tokens
greedily. transformers runs one left-padded `generate()` with its KV cache; Molt submits the
batch to `TorchEngine` at once (continuous batching, all requests concurrent). Reported:

- tok/s: generated tokens / wall time of the whole batch (prefill included, as a user sees it),
  best of `REPEATS` runs on each side;
- Molt compiled: the same engine with `compile=True` (decode steps through `torch.compile`), the
  one compilation outside the timed runs (its time is reported);
- TTFT: transformers = wall time of `generate(max_new_tokens=1)` on the batch; Molt = the mean
  over requests of submission -> first token, in the full run;
- %peak: achieved matmul FLOP/s of Molt's decode (2 x matmul parameters per token, attention
  ignored) over the fp32 peak of one big matmul measured in this run;
- matmul floor: tok/s if the job were nothing but the model's linear layers (the prefill of every
  prompt token at once, then one decode step of the whole batch per new token) with this torch's
  fastest fp32 GEMM at hand (sgemm, oneDNN on prepacked weights, or Molt's own kernel, whichever does
  the job fastest), and that over transformers: what an engine computing the same fp32 model with
  these GEMMs could gain over it at most, whatever else it removes;
- vLLM (when importable, e.g. in `.venv-vllm`): one `vllm.LLM` per model in its default mode
  (torch.compile on CPU), run after the other sides, warm-up then best of `REPEATS` per batch;
  the ratio is the faster Molt (eager or compiled) over it.

Run: `.venv/bin/python benchmarks/engine.py [--quick] [--out NAME]` (writes benchmarks/results/engine.md, or
benchmarks/results/NAME; `--quick` writes only with `--out`); `.venv-vllm/bin/python benchmarks/engine.py --out
engine_vllm_cpu.md` adds vLLM.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from molt.engine import SamplingParams, TorchEngine
from molt.engine.cpu import kernels
from molt.engine.cpu import packed as packed_mod
from molt.engine.torch_engine import on_fresh_thread as _on_fresh_thread
from molt.models import from_pretrained


def on_fresh_thread(fn, *args, threads: int):
    """`fn(*args)` on a fresh thread with `threads` torch threads (Molt's async helper, run to completion)."""
    return asyncio.run(_on_fresh_thread(fn, *args, threads=threads))


CONFIGS = {
    "5M": dict(
        hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2
    ),
    "20M": dict(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4
    ),
}
VOCAB, NEW_TOKENS, BATCHES = 512, 64, (1, 8, 32, 128)
COMPILE_S: list[float] = []  # warm-ups of compiling engines: the first per model compiles, later ones reuse it
REPEATS = 3  # best of, sides alternating: other processes on a 2-core machine stall a 2-thread run badly
THREADS = 2


def matmul_peak_gflops(n: int = 2048, iters: int = 10) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    return 2 * n**3 * iters / (time.perf_counter() - t0) / 1e9


def matmul_floor_s(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds for only the linear layers of the whole job (best of `REPEATS`): every prompt token in one
    prefill pass (LM head on each prompt's last token), then `new_tokens - 1` decode steps of the batch;
    each pass with sgemm, with oneDNN on prepacked weights and with Molt's kernel (as the engine calls it:
    `packed.MAX_ROWS` rows at most), the best."""
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    body, lm_head = weights[:-1], model.lm_head.weight.detach()
    assert weights[-1] is lm_head or weights[-1].data_ptr() == lm_head.data_ptr()
    rows, tokens = len(prompts), sum(len(p) for p in prompts)
    x = {k: torch.randn(tokens, k) for k in {w.shape[1] for w in weights}}
    onednn = {w.data_ptr(): torch.ops.mkldnn._reorder_linear_weight(w) for w in weights}
    molt = {w.data_ptr(): kernels.pack(w) for w in weights} if kernels.load() else {}
    sgemm = torch.nn.functional.linear
    linears = {
        "sgemm": sgemm,
        "oneDNN": lambda x, w: torch.ops.mkldnn._linear_pointwise(x, onednn[w.data_ptr()], None, "none", [], ""),
        "Molt": lambda x, w: (
            kernels.matmul(x, molt[w.data_ptr()], len(w)) if len(x) <= packed_mod.MAX_ROWS else sgemm(x, w)
        ),
    }
    best = float("inf")
    with torch.no_grad():
        for _, (name, linear) in itertools.product(range(REPEATS), linears.items()):
            if name == "Molt" and not molt:
                continue
            t0 = time.perf_counter()
            for w in body:
                linear(x[w.shape[1]], w)
            linear(x[lm_head.shape[1]][:rows], lm_head)
            for _ in range(new_tokens - 1):
                for w in weights:
                    linear(x[w.shape[1]][:rows], w)
            best = min(best, time.perf_counter() - t0)
    return best


def random_prompts(batch: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 65, (batch,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_generate(hf, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds for one left-padded batched greedy generate() of exactly `new_tokens` tokens."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :], mask[row, width - len(p) :] = torch.tensor(p), 1
    t0 = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens
        )
    assert out.shape[1] == width + new_tokens
    return time.perf_counter() - t0


def molt_generate(engine: TorchEngine, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(seconds for the whole batch, mean TTFT seconds) with every request submitted at once."""
    sampling = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)

    async def run():
        return await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))

    t0 = time.perf_counter()
    outs = asyncio.run(run())
    elapsed = time.perf_counter() - t0
    assert all(len(o.token_ids) == new_tokens for o in outs)
    return elapsed, sum(o.metrics["ttft_s"] for o in outs) / len(outs)


def vllm_rates(folder: str, batches) -> dict[int, float]:
    """Generated tok/s of vLLM (if importable) per batch: one `vllm.LLM` per model in its default mode
    (torch.compile on CPU), each batch warmed up once and then timed best of `REPEATS`."""
    try:
        import vllm
    except ImportError:
        return {}
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{THREADS - 1}")  # vLLM's workers: the same cores
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    llm = vllm.LLM(
        model=folder, dtype="float32", max_model_len=256, max_num_seqs=max(batches), skip_tokenizer_init=True
    )
    params = vllm.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    rates = {}
    try:
        for batch in batches:
            inputs = [{"prompt_token_ids": p} for p in random_prompts(batch, seed=batch)]
            llm.generate(inputs, params)
            runs = []
            for _ in range(REPEATS):
                t0 = time.perf_counter()
                llm.generate(inputs, params)
                runs.append(time.perf_counter() - t0)
            rates[batch] = batch * NEW_TOKENS / min(runs)
    finally:
        llm.llm_engine.engine_core.shutdown()  # else its engine process (and KV cache) outlives the model
    return rates


def bench_model(name: str, batches, peak: float) -> list[dict]:
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, max_position_embeddings=512, head_dim=64, **CONFIGS[name])
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = None, 0
    folder = tempfile.mkdtemp(prefix=f"molt-bench-{name}-")
    hf.save_pretrained(folder)
    molt_model = from_pretrained(folder).eval()
    matmul_params = sum(p.numel() for n, p in molt_model.named_parameters() if p.dim() == 2 and "embed" not in n)
    matmul_params += VOCAB * cfg.hidden_size  # the (tied) lm_head
    rows = []
    for batch in batches:
        prompts = random_prompts(batch, seed=batch)
        on_fresh_thread(hf_generate, hf, prompts[:1], 4, threads=THREADS)
        molt_runs, compiled_runs, hf_runs, hf_ttfts = [], [], [], []
        for _ in range(REPEATS):  # alternate the sides; each runs while no other thread holds an OpenMP pool
            for compile, runs in ((False, molt_runs), (True, compiled_runs)):
                engine = TorchEngine(molt_model, num_slots=batch, max_seq_len=160, eos_token_ids=(),
                                     prefix_cache=False, num_threads=THREADS, compile=compile)  # fmt: skip
                t0 = time.perf_counter()
                molt_generate(engine, random_prompts(min(batch, 8), seed=99), 4)  # warm-up (pool; compiles once)
                if compile:
                    COMPILE_S.append(time.perf_counter() - t0)
                runs.append(molt_generate(engine, prompts, NEW_TOKENS))
                asyncio.run(engine.close())  # its thread and pool end before transformers runs
            hf_runs.append(on_fresh_thread(hf_generate, hf, prompts, NEW_TOKENS, threads=THREADS))
            hf_ttfts.append(on_fresh_thread(hf_generate, hf, prompts, 1, threads=THREADS))
        floor_s = on_fresh_thread(matmul_floor_s, molt_model, prompts, NEW_TOKENS, threads=THREADS)
        (molt_s, molt_ttft), hf_s = min(molt_runs), min(hf_runs)
        tokens = batch * NEW_TOKENS
        row = dict(model=name, batch=batch, hf=tokens / hf_s, molt=tokens / molt_s)
        row["compiled"] = tokens / min(compiled_runs)[0]
        row.update(hf_ttft=min(hf_ttfts), molt_ttft=molt_ttft)
        row["peak"] = row["molt"] * 2 * matmul_params / 1e9 / peak
        row["floor"] = tokens / floor_s
        rows.append(row)
    vllm = vllm_rates(folder, batches)  # after Molt and transformers: its worker process holds its own pool
    for row in rows:
        row["vllm"] = vllm.get(row["batch"])
        print(_line(row), flush=True)
    return rows


def _line(r: dict) -> str:
    best = max(r["molt"], r["compiled"])
    vllm = f"{r['vllm']:.0f} | {best / r['vllm']:.2f}x" if r["vllm"] else "n/a | n/a"
    return (
        f"| {r['model']} | {r['batch']} | {r['hf']:.0f} | {r['molt']:.0f} | **{r['molt'] / r['hf']:.2f}x** "
        f"| {r['compiled']:.0f} | **{r['compiled'] / r['hf']:.2f}x** "
        f"| {vllm} "
        f"| {r['hf_ttft'] * 1e3:.1f} | {r['molt_ttft'] * 1e3:.1f} | {100 * r['peak']:.1f}% "
        f"| {r['floor']:.0f} | {r['floor'] / r['hf']:.2f}x |"
    )


def main() -> None:
    torch.set_num_threads(1)  # this thread builds models; compute runs on threads whose OpenMP pool is alone
    quick = "--quick" in sys.argv
    load_start = os.getloadavg()[0]
    peak = on_fresh_thread(matmul_peak_gflops, threads=THREADS)
    header = (
        "| model | batch | transformers tok/s | Molt tok/s | Molt / HF | Molt compiled tok/s | compiled / HF "
        "| vLLM tok/s | best Molt / vLLM | HF TTFT ms | Molt TTFT ms | Molt % fp32 peak | matmul floor tok/s "
        "| floor / HF |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    print(f"fp32 matmul peak: {peak:.0f} GFLOP/s (2 threads)\n{header}")
    rows = []
    for name in CONFIGS:
        rows += bench_model(name, (1, 32) if quick else BATCHES, peak)
    report = [
        "# Engine decode benchmark",
        "",
        f"Generated by `benchmarks/engine.py` on {platform.processor() or platform.machine()},"
        f" torch {torch.__version__}, transformers {transformers.__version__}, 2 threads, fp32;"
        f" {NEW_TOKENS} new tokens per request, greedy,"
        f" prompts of 16-64 random tokens; fp32 matmul peak measured in the same run: {peak:.0f} GFLOP/s.",
        f"Load average (1 min) at the start / end of the run: {load_start:.2f} / {os.getloadavg()[0]:.2f}"
        " (anything well above 0 means other processes shared the 2 cores and the numbers are noisy).",
        "",
        header,
        *(_line(r) for r in rows),
        "",
        "tok/s counts generated tokens over the wall time of the whole batch (prefill included),"
        f" best of {REPEATS} runs per side, the sides alternating. Each side runs with {THREADS} torch threads on"
        " a thread whose OpenMP pool is the only one in the process (the main thread, which builds the models,"
        " stays at 1 thread; transformers and the peak matmul run on fresh threads, Molt on its engine thread,"
        " closed before transformers runs): two live pools would oversubscribe the cores and make libgomp"
        " stop spinning, penalising whichever side ran second. TTFT: best run's mean."
        " Molt compiled: `TorchEngine(compile=True)` (decode steps through torch.compile, a lone row padded to"
        " two); one compilation per model, in the warm-up outside the timed runs:"
        f" {', '.join(f'{t:.0f} s' for t in sorted(COMPILE_S, reverse=True)[: len(CONFIGS)])} in this run (the"
        " other engines reused the graph). vLLM: `vllm.LLM` in its default mode (torch.compile), one per model,"
        " pinned to the same cores, run after the other sides; best of the runs after one warm-up per batch;"
        " n/a where vLLM is not importable.",
    ]
    if quick and "--out" not in sys.argv:  # a quick run leaves the committed results alone
        print("\n".join(report))
        return
    name = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else "engine.md"
    out = Path(__file__).parent / "results" / name
    out.write_text("\n".join(report) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
