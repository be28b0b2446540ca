"""The typed configuration tree: one dataclass per group, validated at construction.

Every field's docstring is its `--help` text (tyro reads them). Groups check their own invariants in
`__post_init__` and name the offending key: `training.py` (model, data, train), `rl.py` (rollout, algo, critic),
`run.py` (eval, ckpt, log, runtime, chat), `base.py` (ConfigError, check, changed). `Config` (here) is the root and
checks combinations across groups. File loading and type checking of TOML/YAML values live in `molt/cli/config_file.py`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from molt.config.base import ConfigError as ConfigError  # re-exported, as is check_device
from molt.config.base import changed, check
from molt.config.rl import AlgoConfig, CriticConfig, RolloutConfig, check_filter_names
from molt.config.run import ChatConfig, CkptConfig, EvalConfig, LogConfig, RuntimeConfig, warn_slow_dtype
from molt.config.run import check_device as check_device
from molt.config.training import DataConfig, ModelConfig, TrainConfig


def _task_has_images(name: str) -> bool:
    """Whether built-in task `name`'s rows hold images (one row drawn; an unknown name is checked elsewhere)."""
    from molt.data.tasks import TASKS, get_task
    from molt.models.vision import message_images

    return name in TASKS and bool(message_images(get_task(name).rows(1, 0)[0]["messages"]))


@dataclass
class Config:
    """Molt's full configuration; `--config FILE` (TOML/YAML) sets any field, flags override it."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    log: LogConfig = field(default_factory=LogConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    chat: ChatConfig = field(default_factory=ChatConfig)
    config: str = ""
    """TOML or YAML file with any of these fields (e.g. `[train]` then `lr = 3e-4`); flags override it. Set by the flag
    only: a config file or dict cannot name another one."""

    def file_form(self) -> dict:
        """This config as a run's config.yaml holds it: plain values, paths absolute (it is read from other folders:
        `molt eval RUN`, `--resume`), `ckpt.resume` and `log.run_dir` cleared (`--config` of it starts a new run in
        a new folder; `--resume` names the folder)."""
        data = json.loads(json.dumps(dataclasses.asdict(self)))  # tuples as lists, for YAML
        data.pop("config")
        data["ckpt"]["resume"] = data["log"]["run_dir"] = ""
        paths = ("model.path", "model.tokenizer", "data.path", "data.eval_path", "algo.teacher", "critic.path")
        for dotted in (*paths, "rollout.replay", "eval.output"):
            group, key = dotted.split(".")
            data[group][key] = data[group][key] and str(Path(data[group][key]).resolve())
        for key in ("agent", "reward"):  # `file.py[:name]` parts, among built-in names and modules
            parts = [part.strip().partition(":") for part in data["rollout"][key].split(",") if part.strip()]
            files = [(str(Path(f).resolve()) if f.endswith(".py") else f, sep, name) for f, sep, name in parts]
            data["rollout"][key] = ",".join("".join(part) for part in files)
        data["algo"]["plugins"] = [str(Path(p).resolve()) if p.endswith(".py") else p for p in self.algo.plugins]
        return data

    def overlong_budget(self) -> int:
        """Generated tokens at which the overlong penalty is full: `algo.overlong_max_len`, else (one turn, which
        the config checks) `rollout.max_tokens`."""
        return self.algo.overlong_max_len or self.rollout.max_tokens

    def _check_policy_kind(self) -> None:
        """Settings that need an MoE, a VLM or a dense text policy, or fit its context, against its architecture."""
        arch, preset = self.model.architecture(), self.model.preset
        if not self.model.path and not arch.num_experts:  # a dense folder is refused when its trainer is built
            for key, on in [
                ("algo.routing_replay", self.algo.routing_replay),
                ("algo.moe_aux_coef", self.algo.moe_aux_coef > 0),
                ("train.freeze_router", self.train.freeze_router),
                ("model.router_fp32", not self.model.router_fp32),
            ]:
                check(not on, key, f"needs a mixture-of-experts model; model.preset {preset!r} is dense")
        for group in (g for g in ("data", "rollout") if changed(getattr(self, g), "max_len")):  # defaults are small
            length, key = getattr(self, group).max_len, f"{group}.max_len"
            check(length <= arch.context_length(), key, f"({length}) is over the model's context "
                  f"({arch.context_length()} positions: max_position_embeddings, with RoPE scaling)")  # fmt: skip
        warm = not self.model.path and self.model.warmstart_steps > 0  # a preset's warm start trains the router
        check(not (self.train.freeze_router and self.train.lora_rank) or warm, "train.freeze_router", "LoRA trains "
              "only its adapters (never the router): the router stays frozen without it")  # fmt: skip
        slot = self.runtime.kv_cache_kind(arch) == "slot"  # the engine factory's choice: its settings are refused
        why = ("sets the paged cache; this run's engine keeps the slot cache (runtime.kv_cache slot; auto on CPU, with "
               "engine_compile or for an MoE or VLM policy), sized by the sequences in flight: add --runtime.kv_cache "
               "paged (dense text models, no engine_compile)")  # fmt: skip
        if slot and (keys := changed(self.runtime, "kv_gb", "kv_memory_fraction", "cuda_graphs")):
            raise ConfigError(f"runtime.{keys[0]}: {why}")
        mlp_only = set(self.train.lora_targets) <= {"gate", "up", "down"}  # MoE experts are not nn.Linear: no adapters
        all_moe = arch.num_moe_layers() == arch.num_layers
        check(not (self.train.lora_rank and mlp_only and all_moe), "train.lora_targets",
              "the model's MLPs are all MoE experts, which LoRA does not adapt; add q k v o")  # fmt: skip
        check(self.runtime.kv_cache != "paged" or not (arch.num_moe_layers() or arch.vision), "runtime.kv_cache",
              "paged serves dense text models; MoE and VLM policies keep the slot cache (slot, or auto)")  # fmt: skip
        check(self.runtime.backend != "ray" or arch.vision is None, "runtime.backend",
              "Ray engine replicas do not take images yet; run VLM policies with --runtime.backend local")  # fmt: skip
        vllm = self.runtime.engine == "vllm"  # it takes token ids only: no images, no routing record
        check(not vllm or arch.vision is None, "runtime.engine", "vllm does not take images yet; run VLM policies "
              "with --runtime.engine torch")  # fmt: skip
        check(not vllm or not self.algo.routing_replay, "algo.routing_replay", "needs the experts the engine chose, "
              "which the vllm engine does not record; use --runtime.engine torch")  # fmt: skip
        text_only = not self.model.path and arch.vision is None
        if text_only and not self.data.path and _task_has_images(self.data.task):
            vlm = "has no vision tower (use a VLM preset, e.g. tiny-vlm)"
            raise ConfigError(f"data.task: {self.data.task!r} rows hold images; model.preset {preset!r} {vlm}")

    def __post_init__(self) -> None:
        warn_slow_dtype(self.model.dtype, self.runtime.device)
        check_filter_names(self.rollout)  # after `algo.plugins` registered theirs
        self._check_policy_kind()
        ro, tr = self.rollout, self.train
        check(not (ro.agent_workers and self.chat.port), "chat.port",
              "must be 0 with rollout.agent_workers: each worker runs its own chat server on a free port")  # fmt: skip
        ranks = self.runtime.trainer_ranks
        self.runtime.check_placement(0 if ro.replay else self.runtime.engines)
        check(ro.prompts_per_step >= ranks, "runtime.trainer_ranks",
              f"({ranks}) must be <= rollout.prompts_per_step: each rank trains whole groups")  # fmt: skip
        check(tr.micro_batch_tokens >= self.data.max_len, "train.micro_batch_tokens", f"({tr.micro_batch_tokens}) "
              f"must be >= data.max_len ({self.data.max_len}) so every sample fits")  # fmt: skip
        cuda = self.runtime.device.startswith("cuda")
        fp32 = self.model.dtype == "float32" or (self.model.dtype == "auto" and not cuda)
        check(tr.precision == "mixed" or not fp32, "train.precision", "pure has no effect here: the compute dtype "
              "(model.dtype; auto = float32 off CUDA) is float32, so the parameters are fp32 either way; set "
              "--model.dtype bfloat16 for bf16 parameters")  # fmt: skip
        compiles = tr.compile == "on" or (tr.compile == "auto" and cuda)
        check(compiles or tr.compile_backend == "inductor", "train.compile_backend", "has no effect here: "
              "train.compile is off (auto compiles on CUDA only); add --train.compile on")  # fmt: skip
        samples = ro.prompts_per_step * ro.n_samples_per_prompt
        check(not self.algo.kl_target or self.algo.kl_horizon >= samples, "algo.kl_horizon", f"({self.algo.kl_horizon})"
              f" must be >= the samples a step trains ({samples}): the adaptive KL moves its coefficient by at most "
              "20% x samples / kl_horizon a step, capped at 20%")  # fmt: skip
        check(not self.algo.overlong_buffer or self.algo.overlong_max_len or ro.max_turns == 1, "algo.overlong_max_len",
              "set it with algo.overlong_buffer when rollout.max_turns > 1: the penalty counts the tokens a rollout "
              "generates in all its turns, and its default is one turn's rollout.max_tokens (or set "
              "--rollout.max_turns 1 for a single-turn task)")  # fmt: skip
        check(self.algo.overlong_buffer <= self.overlong_budget(), "algo.overlong_buffer", f"("
              f"{self.algo.overlong_buffer}) must be <= algo.overlong_max_len ({self.overlong_budget()}; 0 = "
              "rollout.max_tokens)")  # fmt: skip
        given = [f"critic.{k}" for k in changed(self.critic, *CriticConfig.__dataclass_fields__)]  # they need one
        others = f" (and {', '.join(given[1:])}, from the flags or the config file)" if len(given) > 1 else ""
        check(self.algo.needs("values_bt") or not given, given[0] if given else "critic", "has no effect: no critic "
              f"runs with algo.estimator {self.algo.estimator} (only one that needs values_bt, as gae, trains one); "
              f"drop it{others}")  # fmt: skip
