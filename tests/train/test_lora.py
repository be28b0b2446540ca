"""LoRA (`--train.lora_rank`): adapter-only training, exact merge, PEFT-format adapters, checkpoints."""

import copy
import importlib.util
import json
import logging
import os
from pathlib import Path

import pytest
import torch
from conftest import small_model  # noqa: I001 - tests/conftest.py
from test_trainer import _cfg, _model, _trajs

from molt.loop.checkpoint import load_training_state, save_checkpoint
from molt.loop.rl import LoopState
from molt.models import from_pretrained
from molt.train.lora import LoRA
from molt.train.trainer import Trainer

LORA = ("--train.lora_rank", "4", "--train.lora_alpha", "8")
IDS = torch.tensor([[1, 5, 9, 3, 7, 2, 11, 4]])


def _randomize(lora: LoRA, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def test_zero_init_adapters_leave_the_model_unchanged_and_count_r_times_d_in_plus_d_out():
    base = _model()
    model = copy.deepcopy(base)
    lora = LoRA(model, rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down"))
    with torch.no_grad():
        assert torch.equal(model(IDS), base(IDS))
    expect = sum(4 * (m.in_features + m.out_features) for m in lora.linears.values())
    assert sum(p.numel() for p in lora.parameters()) == expect and len(lora.linears) == 7 * model.cfg.num_layers
    assert model.state_dict().keys() == base.state_dict().keys()  # names unchanged: sync and HF export work


def test_the_adapters_start_from_train_seed_whatever_ran_before():
    """Drawn from the global RNG, the adapters depended on what a process did before building the trainer, so the
    local backend and Ray's ranks (which re-seed first) trained LoRA from other starting adapters."""
    starts = []
    for seed in (1, 2):
        torch.manual_seed(seed)  # other work before the trainer is built
        starts.append(Trainer(_model(), _cfg(*LORA)).lora.state_dict())
    assert starts[0].keys() == starts[1].keys() and all(torch.equal(starts[0][k], starts[1][k]) for k in starts[0])
    other = Trainer(_model(), _cfg(*LORA, "--train.seed", "7")).lora.state_dict()
    assert not all(torch.equal(other[k], starts[0][k]) for k in other)  # the seed sets them


def test_merged_forward_equals_the_adapter_forward_and_a_copy_is_the_plain_base():
    model = _model()
    lora = LoRA(model, rank=4, alpha=8.0, targets=("q", "v", "down"))
    _randomize(lora)
    engine_copy = copy.deepcopy(model)  # what the rollout engine holds: adapters must not apply twice
    with torch.no_grad():
        adapted = model(IDS)
        engine_copy.load_state_dict(model.state_dict() | lora.merged_weights())
        assert (engine_copy(IDS) - adapted).abs().max() <= 1e-6
        with lora.merged():
            assert (model(IDS) - adapted).abs().max() <= 1e-6
        name = "layers.0.self_attn.q_proj"
        adapter = lora.adapters[name.replace(".", "__")]
        expect = lora.linears[name].weight + 2.0 * adapter.lora_B @ adapter.lora_A
        assert torch.equal(lora.merged_weights()[f"{name}.weight"], expect)


def test_only_adapters_get_gradients_and_move_and_the_engine_gets_merged_weights():
    model = _model()
    base = copy.deepcopy(model.state_dict())
    trainer = Trainer(model, _cfg(*LORA, "--train.lr", "1e-2"))
    trajs = _trajs(model)
    start = copy.deepcopy(trainer.lora.state_dict())
    trainer.step(trajs)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, base[k]) for k, v in model.state_dict().items())
    assert any(not torch.equal(v, start[k]) for k, v in trainer.lora.state_dict().items())
    weights = trainer.weights()
    merged = trainer.lora.merged_weights()
    assert torch.equal(weights["layers.1.mlp.up_proj.weight"], merged["layers.1.mlp.up_proj.weight"])
    assert not torch.equal(weights["layers.1.mlp.up_proj.weight"], base["layers.1.mlp.up_proj.weight"])


def test_lora_checkpoint_holds_merged_weights_a_peft_adapter_and_resumes_exactly(tmp_path):
    model = _model()
    cfg = _cfg(*LORA, "--train.lr", "1e-2", "--algo.kl_coef", "0.1")
    trainer = Trainer(model, cfg)
    trajs = _trajs(model)
    trainer.step(trajs)
    folder = save_checkpoint(tmp_path, trainer, LoopState(step=1, drops={}), None)
    saved = from_pretrained(folder)
    with torch.no_grad():
        assert (saved(IDS) - model(IDS)).abs().max() <= 1e-5  # the HF folder is the merged policy
    config = json.loads((folder / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    resumed = Trainer(saved, cfg)
    load_training_state(folder, resumed)
    after, again = trainer.step(trajs), resumed.step(trajs)
    assert after["train/loss"] == again["train/loss"]
    for name, value in trainer.weights().items():
        assert torch.equal(value, resumed.weights()[name]), name


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed")
def test_peft_loads_the_adapter_onto_the_transformers_model_with_equal_logits(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from molt.models import save_pretrained

    model = _model()
    base_folder = save_pretrained(model, tmp_path / "base")
    with torch.no_grad():
        base_logits = model(IDS)
    lora = LoRA(model, rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down"))
    _randomize(lora, seed=1)
    lora.save_peft(tmp_path / "adapter", os.path.relpath(base_folder))  # as --model.path may name it
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(Path(base_folder).resolve())  # loadable from any folder
    hf = AutoModelForCausalLM.from_pretrained(base_folder, torch_dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        ours, theirs = model(IDS), peft_model(input_ids=IDS).logits
    assert (ours - theirs).abs().max() <= 1e-4
    assert (ours - base_logits).abs().max() > 1e-3  # the adapter matters


def test_lora_config_checks():
    from molt.config import Config, ConfigError, ModelConfig, RuntimeConfig, TrainConfig

    with pytest.raises(ConfigError, match="train.lora_targets: unknown lm_head; choose from"):
        TrainConfig(lora_rank=4, lora_targets=("q", "lm_head"))
    Config(train=TrainConfig(lora_rank=4), runtime=RuntimeConfig(backend="ray"))  # sharded by the trainer ranks
    with pytest.raises(ConfigError, match="train.lora_targets: the model's MLPs are all MoE experts"):
        Config(model=ModelConfig(preset="tiny-moe"), train=TrainConfig(lora_rank=4, lora_targets=("gate", "up")))


def test_an_moe_models_adapter_names_only_what_was_adapted(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="molt.train"):
        lora = LoRA(small_model(kind="moe"), rank=4, alpha=8.0, targets=("q", "gate"))
    assert "train.lora_targets gate: no such nn.Linear" in caplog.text and "adapting q" in caplog.text
    lora.save_peft(tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"] == ["q_proj"]


def test_adapters_stay_float32_beside_a_bf16_base_and_train_in_its_dtype():
    """`--train.precision pure`: bf16 adapters (and AdamW state) lost most of A's small updates; fp32 ones keep them."""
    model = _model().to(torch.bfloat16)
    lora = LoRA(model, rank=4, alpha=8.0, targets=("q", "v"))
    _randomize(lora)
    assert all(p.dtype == torch.float32 for p in lora.parameters())
    out = model(IDS)
    assert out.dtype == torch.bfloat16
    out.float().logsumexp(-1).sum().backward()
    a = next(iter(lora.adapters.values())).lora_A
    before = a.detach().clone()
    torch.optim.AdamW(lora.parameters(), lr=1e-5).step()
    assert a.grad.dtype == torch.float32 and (a.detach() != before).float().mean() > 0.99
    merged = lora.merged_weights()
    assert all(w.dtype == torch.bfloat16 for w in merged.values())
