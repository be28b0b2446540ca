"""LoRA adapters around a model's linear layers, applied from outside the model code (`--train.lora_rank`).

`LoRA(model, rank, alpha, targets)` adds `scale * B @ A x` (scale = alpha / rank, B zero-initialised, so the
adapted model starts equal to the base) to every targeted `nn.Linear` of the decoder layers through a forward
hook. The model's modules, parameter names and state dict are untouched, so weight sync, HF export and
checkpoints keep their names; only the adapters train. A hook fires only on the very module it was made for: a
copy of the model (e.g. the rollout engine's) is the plain base model and takes merged weights instead
(`merged_weights`, or `merge` on each full tensor gathered from FSDP2 shards; the adapters stay whole on every
rank). `save_peft` writes the adapters in the PEFT format. Knows the decoder's module names; nothing of RL."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from molt.config import ConfigError
from molt.models import save_pretrained

log = logging.getLogger("molt.train")
TARGETS = {t: f"self_attn.{t}_proj" for t in "qkvo"} | {t: f"mlp.{t}_proj" for t in ("gate", "up", "down")}


class Adapter(nn.Module):
    """One low-rank update: A [r, d_in] (Kaiming-uniform, as PEFT), B [d_out, r] (zeros); float32 beside a bf16 base
    too (as PEFT): a bf16 A and its AdamW state lose most updates (`--train.precision pure`), for a few MB."""

    def __init__(self, linear: nn.Linear, rank: int, generator: torch.Generator):
        super().__init__()
        a = nn.init.kaiming_uniform_(torch.empty(rank, linear.in_features), a=math.sqrt(5), generator=generator)
        self.lora_A = nn.Parameter(a.to(linear.weight.device))
        self.lora_B = nn.Parameter(torch.zeros(linear.out_features, rank, device=linear.weight.device))


class LoRA(nn.Module):
    """The adapters of one model, keyed by the targeted modules' names (`layers.N.self_attn.q_proj`)."""

    def __init__(self, model: nn.Module, rank: int, alpha: float, targets: tuple[str, ...], seed: int = 0):
        super().__init__()
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        pattern = re.compile(rf"layers\.\d+\.({'|'.join(re.escape(TARGETS[t]) for t in targets)})")
        self.linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and pattern.fullmatch(n)}
        unmatched = [t for t in targets if not any(n.endswith("." + TARGETS[t]) for n in self.linears)]
        if unmatched:  # MoE experts are stacked tensors, not nn.Linear
            what = f"train.lora_targets {','.join(unmatched)}: no such nn.Linear in the model's layers"
            if not self.linears:
                raise ConfigError(what)
            adapted = ",".join(sorted(set(targets) - set(unmatched)))
            log.warning("%s (MoE experts are not adapted); adapting %s", what, adapted)
        if getattr(model, "vision", None) is not None:  # a VLM: the LM's linears only (docs/vlm.md)
            log.warning("LoRA adapts the language model's layers; the vision tower and its projector stay frozen")
        model.requires_grad_(False)
        generator = torch.Generator().manual_seed(seed)  # the same adapters in every process (Ray ranks, a replay)
        self.adapters = nn.ModuleDict({_key(n): Adapter(m, rank, generator) for n, m in self.linears.items()})
        self.enabled = True
        for name, linear in self.linears.items():
            linear.register_forward_hook(self._hook(linear, self.adapters[_key(name)]))

    def _hook(self, target: nn.Linear, adapter: Adapter):
        def add_update(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
            if module is not target or not self.enabled:  # a copy of the model, or adapters off
                return None
            x = args[0]  # in FSDP2's compute dtype when sharded: the (fp32, unsharded) adapters follow it
            return out + self.scale * F.linear(F.linear(x, adapter.lora_A.to(x.dtype)), adapter.lora_B.to(x.dtype))

        return add_update

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The base model's forward (e.g. a reference policy without a second copy)."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    def merged_weights(self) -> dict[str, torch.Tensor]:
        """`{name.weight: W + scale * B @ A}` for every target (the model's own names)."""
        return {f"{name}.weight": self.merge(f"{name}.weight", linear.weight) for name, linear in self.linears.items()}

    @torch.no_grad()
    def merge(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """The state-dict entry `name` with its adapter merged (`weight + scale * B @ A`) if it is a target's weight,
        else `weight` itself (e.g. each full tensor gathered from FSDP2 shards)."""
        module = name.removesuffix(".weight")
        if module == name or module not in self.linears:
            return weight
        adapter = self.adapters[_key(module)]
        delta = (adapter.lora_B @ adapter.lora_A).to(weight.device, weight.dtype)
        return weight.detach() + self.scale * delta

    def base_weights(self) -> dict[str, torch.Tensor]:
        """The frozen targets' own weights (a resumed run restores them exactly)."""
        return {f"{name}.weight": linear.weight.detach().clone() for name, linear in self.linears.items()}

    @torch.no_grad()
    def load_base_weights(self, weights: dict[str, torch.Tensor]) -> None:
        for name, linear in self.linears.items():
            linear.weight.copy_(weights[f"{name}.weight"])

    def resume_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """What a resume needs beside the HF folder (which holds merged weights): the adapters and the base weights."""
        return {"adapters": self.state_dict(), "base": self.base_weights()}

    def load_resume_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        self.load_state_dict(state["adapters"])
        self.load_base_weights(state["base"])

    @contextlib.contextmanager
    def merged(self) -> Iterator[None]:
        """The model holds the merged weights and runs without hooks inside the block (an HF export)."""
        merged = self.merged_weights()
        originals = {name: linear.weight.data for name, linear in self.linears.items()}
        with self.disabled():
            try:
                for name, linear in self.linears.items():
                    linear.weight.data = merged[f"{name}.weight"]
                yield
            finally:
                for name, linear in self.linears.items():
                    linear.weight.data = originals[name]

    def save_peft(self, folder: str | Path, base_model: str = "") -> None:
        """Write `adapter_config.json` + `adapter_model.safetensors` that `peft.PeftModel.from_pretrained` loads;
        the base model folder is named by its absolute path (`AutoPeftModelForCausalLM` loads it from any folder)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": str(Path(base_model).resolve()) if base_model else None,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": 0.0,
            "target_modules": sorted({name.rsplit(".", 1)[-1] for name in self.linears}),  # those adapted
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "modules_to_save": None,
            "inference_mode": True,
        }
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        state = {  # PEFT's names for an HF causal LM (`base_model.model.model.<name>.lora_A.weight`), fp32
            f"base_model.model.model.{name}.{ab}.weight": weight.detach().float().contiguous().cpu()
            for name in self.linears
            for ab, weight in self.adapters[_key(name)].named_parameters()  # lora_A, lora_B
        }
        save_file(state, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})


def save_policy(model: nn.Module, lora: LoRA | None, folder: str | Path, tokenizer, base_model: str = "") -> Path:
    """`model` as an HF folder; with `lora` its merged weights, plus the adapters in PEFT format in `adapter/`."""
    with lora.merged() if lora is not None else contextlib.nullcontext():
        folder = save_pretrained(model, folder, tokenizer=tokenizer)
    if lora is not None:
        lora.save_peft(Path(folder) / "adapter", base_model)
    return Path(folder)


def _key(name: str) -> str:
    """A module name as a ModuleDict key (no dots)."""
    return name.replace(".", "__")
