"""Graphed decode (`graphs.py`) and decode attention over block tables (`paged_attention.py`) on CPU: the static
buffers, padding rows and scratch block run eagerly here (CUDA captures the same forward); the Triton kernel runs
in Triton's interpreter where Triton is installed."""

import asyncio
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import random_hf_in_molt  # noqa: I001 - tests/conftest.py
from engine_refs import prompts, trainer_logprobs

from molt.engine import SamplingParams, TorchEngine
from molt.engine.graphs import batch_buckets
from molt.engine.paged_attention import torch_paged_decode


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 4]
    assert batch_buckets(16) == [1, 2, 4, 8, 16]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 48]


def paged_case(dtype=torch.float32, heads=4, kv_heads=2, head_dim=32, seed=0):
    """A cache of 12 blocks of 16, three rows with scattered tables and lengths that end mid-block."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(12, kv_heads, 16, head_dim, generator=g).to(dtype)
    v = torch.randn(12, kv_heads, 16, head_dim, generator=g).to(dtype)
    table = torch.tensor([[3, 5, 7, 1], [2, 0, 0, 0], [11, 10, 9, 8]], dtype=torch.int32)
    lens = torch.tensor([50, 9, 64], dtype=torch.int32)
    q = torch.randn(3, heads, head_dim, generator=g).to(dtype)
    return q, k, v, table, lens


def dense_reference(q, k, v, table, lens):
    """Each row's keys laid out by hand from its table, plain softmax attention per head."""
    outs = []
    for n in range(q.shape[0]):
        blocks = table[n, : -(-int(lens[n]) // 16)].long()
        keys = k[blocks].transpose(0, 1).reshape(k.shape[1], -1, k.shape[3])[:, : lens[n]]
        values = v[blocks].transpose(0, 1).reshape(v.shape[1], -1, v.shape[3])[:, : lens[n]]
        group = q.shape[1] // k.shape[1]
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        probs = F.softmax(q[n, :, None] @ keys.transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1)
        outs.append((probs @ values)[:, 0])
    return torch.stack(outs)


def test_torch_paged_decode_equals_attention_over_the_rows_own_positions():
    q, k, v, table, lens = paged_case()
    out = torch_paged_decode(q, k, v, table, lens, q.shape[-1] ** -0.5)
    assert (out - dense_reference(q, k, v, table, lens)).abs().max() <= 1e-5


TRITON_CHECK = """
import os, torch
os.environ["TRITON_INTERPRET"] = "1"
from molt.engine.paged_attention import triton_paged_decode
from test_graphs import dense_reference, paged_case
# the interpreter's bf16 matrix product is broken (Triton 3.9): fp32 and fp16 here, bf16 on the GPU benchmark
for dtype, heads, kv, tol in [(torch.float32, 4, 2, 1e-5), (torch.float32, 2, 2, 1e-5), (torch.float16, 16, 8, 2e-3)]:
    q, k, v, table, lens = paged_case(dtype, heads, kv)
    ref = dense_reference(q.float(), k.float(), v.float(), table, lens)
    for tile in (16, 64):
        out = triton_paged_decode(q, k, v, table, lens, q.shape[-1] ** -0.5, tile=tile)
        err = (out.float() - ref).abs().max().item()
        assert err <= tol, (dtype, heads, kv, tile, err)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (CUDA builds ship it)")
def test_triton_kernel_in_the_interpreter():
    """The CUDA kernel's logic (tiles across block edges, masked tails, head groups padded to 16) on CPU."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), *sys.path]))
    run = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-3000:]


@pytest.fixture(scope="module")
def molt(tmp_path_factory):
    return random_hf_in_molt("qwen3", tmp_path_factory.mktemp("qwen3"))


def engine(model, graphs: bool, **kw) -> TorchEngine:
    kw = dict(num_slots=6, max_seq_len=64, kv_blocks=40, block_size=4, eos_token_ids=()) | kw
    return TorchEngine(model, graphs=graphs, **kw)


def test_graphed_decode_equals_the_eager_paged_path(molt):
    """Batches of 1..6 rows padded to buckets 1/2/4/8, shared prompts (n = 2), block pressure (preemption and
    recompute): the same tokens and log-probs as the eager paged path, and the trainer's log-probs."""
    ps = prompts([5, 23, 1, 14, 9], seed=3)
    requests = [(p, SamplingParams(n=1 + i % 2, temperature=1.0, max_tokens=9 + i, seed=i)) for i, p in enumerate(ps)]

    def run(graphs: bool, **kw):
        e = engine(molt, graphs, **kw)

        async def go():
            return await asyncio.gather(*(e.generate_group(p, sp) for p, sp in requests))

        outs = asyncio.run(go())
        stats = dict(e.stats)
        asyncio.run(e.close())
        return outs, stats, e

    ref, _, _ = run(False)
    for kw in ({}, dict(kv_blocks=16)):  # 16 blocks of 4: fewer than the rows need at once
        outs, stats, e = run(True, **kw)
        assert e.core.runner.graphs is not None and stats["decode_only_steps"] > 0
        for (p, _), group, ref_group in zip(requests, outs, ref, strict=True):
            assert [c.token_ids for c in group] == [c.token_ids for c in ref_group]
            for c in group:
                assert (torch.tensor(c.logprobs) - trainer_logprobs(molt, p, c, 1.0)).abs().max() <= 1e-5
    assert e.core.scheduler.num_preemptions > 0


def test_padding_rows_touch_only_the_scratch_block(molt):
    """A step of 3 rows runs the bucket of 4: the padding row writes the scratch block, no sequence's block."""
    e = engine(molt, True, num_slots=4)
    runner = e.core.runner
    p = prompts([6], seed=1)[0]
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=5, seed=1)
    asyncio.run(e.generate_group(p, sp))
    scratch = runner.graphs.scratch
    assert scratch == runner.k.shape[1] - 1 and runner.k[:, scratch].abs().sum() > 0  # padding wrote there
    asyncio.run(e.close())


def test_graph_inputs_are_each_rows_block_table_and_padding(molt):
    """Each graphed step's one packed input buffer, written from the manager's per-slot table rows: per decode row
    its token, position, length, write row and block table (the block manager's, padded with the scratch block),
    then padding rows; under forks (n = 2) and preemption."""
    e = engine(molt, True, kv_blocks=16)
    graphs, manager, kv_heads = e.core.runner.graphs, e.core.manager, e.core.runner.kv_heads
    width, bs, step, sizes = manager.tables_sm.shape[1], manager.blocks.block_size, graphs.step, []

    def checked_step(decode):
        out = step(decode)
        bucket = next(b for b in graphs.buckets if b >= len(decode))
        want = []
        for slot, token, pos in decode:
            table = manager.table_at(slot)
            write = (table[pos // bs] * kv_heads) * bs + pos % bs
            want.append([token, pos, pos + 1, write, *table] + [graphs.scratch] * (width - len(table)))
        assert graphs.inputs[:bucket].tolist() == want + [graphs.pad_row.tolist()] * (bucket - len(decode))
        sizes.append(len(decode))
        return out

    graphs.step = checked_step
    ps = prompts([5, 23, 1, 14, 9], seed=3)
    sps = [SamplingParams(n=1 + i % 2, temperature=1.0, max_tokens=9 + i, seed=i) for i in range(len(ps))]

    async def go():
        return await asyncio.gather(*(e.generate_group(p, sp) for p, sp in zip(ps, sps, strict=True)))

    asyncio.run(go())
    asyncio.run(e.close())
    assert sizes and max(sizes) > 2 and e.core.scheduler.num_preemptions > 0
