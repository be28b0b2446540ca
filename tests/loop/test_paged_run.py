"""The engine's KV cache choice from the config, and a training run on the paged cache."""

import copy

from test_loop import FAST  # noqa: I001 - tests/loop/test_loop.py

from molt.cli.main import parse_config
from molt.cli.train import run_train
from molt.models import PRESETS
from molt.runtime.factory import engine_kwargs


def test_auto_is_slot_on_cpu_and_paged_on_cuda_for_dense_text_models():
    cfg = parse_config([])
    assert cfg.runtime.kv_cache_kind(PRESETS["tiny"]) == "slot"
    cuda = copy.copy(cfg)
    cuda.runtime = copy.copy(cfg.runtime)
    cuda.runtime.device = "cuda"  # set after validation: this machine may have no GPU
    assert cuda.runtime.kv_cache_kind(PRESETS["tiny"]) == "paged"
    assert cuda.runtime.kv_cache_kind(PRESETS["tiny-moe"]) == cuda.runtime.kv_cache_kind(PRESETS["tiny-vlm"]) == "slot"
    assert engine_kwargs(cuda, PRESETS["tiny"])["kv_memory_fraction"] == 0.4
    assert engine_kwargs(cuda, PRESETS["tiny"])["graphs"] is True  # decode from captured CUDA graphs
    cuda.runtime.cuda_graphs = False
    assert engine_kwargs(cuda, PRESETS["tiny"])["graphs"] is False
    cuda.runtime.engine_compile = True  # the compiled decode step is the slot cache's: compile is never ignored
    assert cuda.runtime.kv_cache_kind(PRESETS["tiny"]) == "slot" and engine_kwargs(cuda, PRESETS["tiny"])["compile"]
    paged = parse_config(["--runtime.kv_cache", "paged", "--runtime.kv_gb", "0.5"])
    assert engine_kwargs(paged, PRESETS["tiny"])["kv_bytes"] == 500_000_000
    assert engine_kwargs(paged, PRESETS["tiny"])["graphs"] is False  # CPU: no capture
    slots = engine_kwargs(parse_config(["--runtime.kv_cache", "paged"]), PRESETS["tiny"])
    assert slots["kv_blocks"] * 16 >= slots["num_slots"] * slots["max_seq_len"]  # the slot cache's positions


def test_on_policy_run_on_the_paged_cache_matches_the_trainer(tmp_path):
    flags = [*FAST, "--log.run_dir", str(tmp_path / "run"), "--train.max_steps", "3", "--rollout.max_staleness", "0",
             "--runtime.kv_cache", "paged", "--runtime.kv_gb", "0.002"]  # fmt: skip
    result = run_train(parse_config(flags))
    steps = [m for m in result.history if "train/logprob_diff" in m]
    assert len(steps) == 3 and all(m["train/logprob_diff"] <= 1e-5 for m in steps)
