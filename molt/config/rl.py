"""The RL groups: how episodes are generated (`rollout`), the objective (`algo`: names resolve in molt/algo's
registries, settings that cannot change training are refused) and the PPO critic (`critic`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from molt.config.base import ConfigError, changed, check, check_bounds, expand_user
from molt.config.training import check_finite, check_model_folder
from molt.user_code import import_failure, import_once

OWN = " (a variant of your own: --algo.plugins my_variants.py registers it; docs/algorithms.md)"


@dataclass
class RolloutConfig:
    """How episodes are generated: agent, groups, sampling, budgets, and the staleness bound."""

    agent: str = ""
    """Agent class as `file.py[:Name]` or `pkg.module[:Name]`. Default: the task's built-in Env (or, with
    `reward`, a single-turn episode)."""
    reward: str = ""
    """Reward function(s), comma-separated: built-in `math`, `format`, `exact`, `think_format`, or
    `file.py[:fn]` / `pkg.module:fn` called as fn(completion, row) -> float | dict[str, float]. Without
    `agent`: single-turn episodes; with it, scores the agent's final answer (replacing its reward)."""
    reward_weights: str = ""
    """Weights of named rewards as NAME=W[,...] (e.g. `format=0.2`); the reward is the weighted sum (default 1)."""
    prompts_per_step: int = 8
    """Prompt groups per optimizer step (the batch is prompts_per_step x n_samples_per_prompt)."""
    n_samples_per_prompt: int = 8
    """Samples per prompt (a group; group baselines such as GRPO compare within it)."""
    max_staleness: int = 1
    """Max versions between the weights that sampled a token and the trainer step using it (0 = sync)."""
    sync_mode: Literal["drain", "interrupt"] = "interrupt"
    """Weight sync: `drain` waits for in-flight requests; `interrupt` swaps at a token boundary."""
    temperature: float = 1.0
    """Sampling temperature (also used by the trainer's log-probs)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 = off). Below 1 (or with top_k), the engine records the log-probs of the truncated
    distribution it sampled from, and the IS correction (`algo.is_level`, required) corrects the trainer for it."""
    top_k: int = 0
    """Top-k sampling (0 = off); see top_p."""
    max_tokens: int = 32
    """Max generated tokens per turn (clipped to the remaining context)."""
    max_turns: int = 4
    """Max policy turns per episode."""
    max_len: int = 192
    """Context budget per episode in tokens (prompt + actions + observations)."""
    step_timeout_s: float = 30.0
    """Timeout of one agent call (an Env's reset/step; a ChatAgent's whole run gets step_timeout_s x max_turns, the
    time its model calls take not counted: its SDK client's own `timeout`, 600 s by default, bounds each of those, as
    over a socket); a timeout fails that rollout only. Agent code
    (a constructor too) that blocks the event loop this long stops the run, naming its line."""
    max_failure_frac: float = 0.2
    """Stop the run when more than this fraction of rollouts failed (after 20 rollouts)."""
    filters: tuple[str, ...] = ("auto",)
    """Group filters (dropped groups are refilled from new prompts): nonfinite, all-equal, score-range; `auto`:
    nonfinite all-equal where the estimator compares a rollout with its group, else (reinforce, gae,
    on_policy_distill: an all-equal group still carries signal there) nonfinite only (`auto my-filter`: those and
    a plugin's)."""
    score_range: tuple[float, float] = (0.0, 1.0)
    """The `score-range` filter keeps a group whose mean reward (or score) is strictly inside (low, high) (DAPO's
    0 < mean < 1: drops the groups all failed or all solved)."""
    filter_on: Literal["reward", "score"] = "reward"
    """What the group filters read: `reward` (the trained signal, e.g. partial credit) or the agent's `score`
    (e.g. a 0/1 success; a rollout without one uses its reward)."""
    max_in_flight: int = 0
    """Episodes generating at once; 0 = all the staleness bound lets start ((max_staleness + 1) x batch)."""
    agent_workers: int = 0
    """Run rollouts (agent code, its SDK clients, its chat server, reward functions) in this many worker processes;
    0: on the loop's event loop. Workers take the agent's Python off the engine's process (one GIL): worth it for
    ChatAgents and CPU-heavy agent code; each costs a Python process (~2-4 s to start, a few hundred MB)."""
    dump: bool = False
    """Write every trained batch to `<run_dir>/rollouts/step-<N>.jsonl` (tokens, loss masks, engine log-probs,
    versions, rewards, MoE routing, image hashes; pixels under `rollouts/images/`), for `--replay`."""
    replay: str = ""
    """Train on a dump instead of rollouts: a run directory or its `rollouts/` folder (`molt train --replay DIR`
    also takes the run's config.yaml). No engine is built; token and version checks stay on."""

    def __post_init__(self) -> None:
        expand_user(self, "replay")
        check_bounds(self, prompts_per_step="> 0", n_samples_per_prompt="> 0", max_staleness=">= 0")
        check(self.temperature == 0 or self.temperature >= 1e-4, "rollout.temperature", "must be 0 (greedy: molt "
              "serve's only) or >= 1e-4, the engine's smallest, below which logits / T overflow fp32")  # fmt: skip
        check_finite(self, "rollout", allow_inf=("step_timeout_s",))
        check(0 < self.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
        check(self.top_k >= 0, "rollout.top_k", "must be >= 0 (0 = off)")
        check(self.max_tokens > 0 and self.max_turns > 0, "rollout.max_tokens", "max_tokens and max_turns must be > 0")
        check(0 <= self.max_failure_frac <= 1, "rollout.max_failure_frac", "must be in [0, 1]")
        check_bounds(self, max_in_flight=">= 0", agent_workers=">= 0")
        check(bool(self.reward) or not self.reward_weights, "rollout.reward_weights", "needs rollout.reward")
        for key in ("agent", "reward"):  # the workers are fresh interpreters: they do not run the caller's script
            check(not self.agent_workers or "__main__:" not in getattr(self, key), f"rollout.{key}", "'__main__:NAME' "
                  "is defined in your script, which rollout.agent_workers processes do not run: put it in a file "
                  f"(--rollout.{key} my_{key}.py) or set rollout.agent_workers 0")  # fmt: skip
        check_bounds(self, step_timeout_s="> 0", max_len="> 1 (prompt tokens + room to generate)")
        check(not self.replay or os.path.isdir(self.replay), "rollout.replay", f"folder {self.replay!r} does not exist")
        check(self.filter_on == "reward" or bool(self.filters), "rollout.filter_on", "has no effect without filters")
        low, high = self.score_range  # check_finite refused NaN and infinity above
        check(low < high, "rollout.score_range", "needs finite low < high")
        check("score-range" in self.filters or not changed(self, "score_range"), "rollout.score_range",
              "has no effect here: add score-range to --rollout.filters")  # fmt: skip

    def group_filters(self, estimator: str) -> tuple[str, ...]:
        """The group filters a run with `estimator` applies: `filters`, with `auto` resolved for it."""
        from molt.algo import ESTIMATORS

        auto = ("nonfinite", "all-equal") if ESTIMATORS.info(estimator)["group_baseline"] else ("nonfinite",)
        return tuple(dict.fromkeys(f for name in self.filters for f in (auto if name == "auto" else (name,))))

    @property
    def episodes_in_flight(self) -> int:
        """`max_in_flight`, or every episode the staleness bound lets start."""
        return self.max_in_flight or (self.max_staleness + 1) * self.prompts_per_step * self.n_samples_per_prompt


@dataclass
class AlgoConfig:
    """The RL objective: names resolve in molt/algo's registries (see docs/algorithms.md)."""

    estimator: str = "grpo"
    """Advantage estimator: grpo, dr_grpo, rloo, reinforce_baseline, reinforce, gae, on_policy_distill."""
    policy_loss: str = "ppo"
    """Policy surrogate: ppo, gspo, cispo, pg. Fixed to ppo in molt train, as are the clips below: one optimizer step
    per batch makes the ratio to the proximal policy exactly 1, where all four have one gradient."""
    loss_agg: str = "token-mean"
    """Loss aggregation with a global denominator per step (token-mean, seq-mean-token-mean, ...)."""
    norm_len: int = 0
    """seq-mean-token-sum-norm's constant divisor L (Dr. GRPO: the generation budget, e.g. rollout.max_tokens); that
    aggregation needs it, the others refuse it."""
    plugins: tuple[str, ...] = ()
    """Your own variants: Python files (my_algo.py) or modules, imported before any name here is checked; each
    registers estimators, losses, filters, ... (docs/algorithms.md). config.yaml records them: resume and replay
    import them too."""
    clip_low: float = 0.2
    """PPO clip: ratio >= 1 - clip_low."""
    clip_high: float = 0.28
    """PPO clip: ratio <= 1 + clip_high (clip-higher when > clip_low)."""
    dual_clip: float = 0.0
    """Dual-clip constant c > 1 for negative advantages (0 = off)."""
    whiten: bool | None = None
    """Whiten advantages over the batch (None = the estimator's default)."""
    is_level: str = "token"
    """Train/rollout importance-sampling correction level: token, seq, geo, or none."""
    is_mode: str = "trunc"
    """IS correction mode: mask, clip, trunc."""
    is_low: float = 0.5
    """IS band low end."""
    is_high: float = 2.0
    """IS band high end."""
    kl_coef: float = 0.0
    """KL-to-reference loss coefficient (> 0 builds a frozen reference copy of the initial policy)."""
    kl_estimator: str = "k3"
    """KL estimator for the loss term: k3 (its expected gradient is the forward KL(ref || policy)'s) or k2 (KL(policy
    || ref)'s); k1 is refused (its expected gradient is 0). KL rewards (reinforce, gae, distillation) use k1."""
    kl_target: float = 0.0
    """Adaptive KL (Ziegler et al. 2019): the KL to the reference (train/kl) the coefficient steers to. It starts at
    `kl_coef`; after each step beta *= 1 + clip(train/kl / kl_target - 1, +-0.2) * min(samples / kl_horizon, 1)
    (logged as train/kl_coef). 0 = a fixed coefficient."""
    kl_horizon: int = 10000
    """Adaptive KL horizon in samples (at least a step's): the larger, the slower the coefficient moves (needs
    kl_target)."""
    reward_clip: float = 0.0
    """Clip each rollout's reward (after the overlong penalty) to [-reward_clip, reward_clip] before the estimator
    and the critic's returns (0 = off). Group filters still read the unshaped reward."""
    overlong_buffer: int = 0
    """DAPO soft overlong penalty (0 = off): a rollout that generated more than overlong_max_len - overlong_buffer
    tokens (all turns together) loses reward linearly, overlong_coef at overlong_max_len and beyond."""
    overlong_max_len: int = 0
    """Generated tokens (all turns) at which the overlong penalty is full (0 = rollout.max_tokens; needed with
    rollout.max_turns > 1)."""
    overlong_coef: float = 1.0
    """Reward the overlong penalty takes away at overlong_max_len (needs overlong_buffer)."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    routing_replay: bool = False
    """MoE models (R3): the trainer's forward uses the experts the rollout engine chose per token and
    layer (gate values still come from the live router, which keeps learning). See docs/moe.md."""
    moe_aux_coef: float = 0.0
    """MoE models: coefficient of the Switch load-balancing loss (E * sum_e f_e * P_e, mean over layers)."""
    moe_diff_both: bool = True
    """MoE models with recorded routing: one more trainer forward (no grad) with the other routing mode, so
    each step reports both `moe/logprob_diff_replay` and `moe/logprob_diff_live` (a step takes ~1.25x as long)."""
    gamma: float = 1.0
    """Discount per action token (gae, reinforce)."""
    lam: float = 1.0
    """GAE lambda (gae)."""
    teacher: str = ""
    """On-policy distillation: HF model folder of the teacher (same tokenizer; any size, dense or MoE). The per-token
    reverse KL log pi(a_t) - log teacher(a_t) on the sampled tokens is the advantage of `on_policy_distill`, or is
    subtracted from another estimator's advantage (weighted by `teacher_coef`)."""
    teacher_coef: float = 1.0
    """Weight of the reverse-KL-to-teacher advantage: A_t -= teacher_coef * (log pi(a_t) - log teacher(a_t))."""

    def __post_init__(self) -> None:
        from molt import algo

        self.plugins = tuple(os.path.expanduser(p) for p in self.plugins)
        for spec in self.plugins:  # first: they register names the checks below look up
            check(not spec.endswith(".py") or os.path.isfile(spec), "algo.plugins", f"file {spec!r} does not exist")
            try:
                import_once(spec)
            except Exception as e:  # noqa: BLE001 - the user's code: where it failed
                raise ConfigError(f"algo.plugins: {import_failure(spec, e)}") from None
        check_finite(self, "algo", allow_inf=("is_high",))  # is_high inf: no upper bound
        for key, registry in (("estimator", algo.ESTIMATORS), ("policy_loss", algo.POLICY_LOSSES),
                              ("loss_agg", algo.AGGREGATIONS), ("kl_estimator", algo.KL_ESTIMATORS)):  # fmt: skip
            check(getattr(self, key) in registry, f"algo.{key}", f"unknown; choose one of {registry.names()}{OWN}")
        check(0 <= self.gamma <= 1 and 0 <= self.lam <= 1, "algo.gamma", "gamma and lam must be in [0, 1]")
        for key, note in (("gamma", ""), ("lam", "; reinforce is gae with V = 0 and lambda 1")):
            readers = [n for n in algo.ESTIMATORS.names() if key in algo.ESTIMATORS.info(n).get("reads", (key,))]
            check(getattr(self, key) == 1.0 or self.estimator in readers, f"algo.{key}", "applies to the estimators "
                  f"that read it ({', '.join(readers)}), not {self.estimator!r}{note}")  # fmt: skip
        check(not self.needs("kl_bt") or bool(self.teacher), "algo.teacher", f"--algo.estimator {self.estimator} "
              "needs --algo.teacher PATH (the teacher's HF model folder)")  # fmt: skip
        self.teacher = self.teacher and check_model_folder(self.teacher, "algo.teacher")
        check(not self.teacher or self.teacher_coef > 0, "algo.teacher_coef", "must be > 0 with algo.teacher")
        check(self.is_level == "none" or self.is_level in algo.IS_LEVELS, "algo.is_level",
              f"unknown {self.is_level!r}; choose from {[*algo.IS_LEVELS.names(), 'none']}{OWN}")  # fmt: skip
        check_bounds(self, moe_aux_coef=">= 0", kl_coef=">= 0 (0 = no KL term, no reference model)")
        check(self.kl_target >= 0 and self.kl_horizon > 0, "algo.kl_target", "kl_target >= 0, kl_horizon > 0")
        check(self.reward_clip >= 0, "algo.reward_clip", "must be >= 0 (0 = off)")
        check(self.norm_len > 0 or not algo.AGGREGATIONS.info(self.loss_agg).get("needs_norm_len"), "algo.norm_len",
              f"--algo.loss_agg {self.loss_agg} divides each sequence's token sum by this constant: set it > 0 "
              "(Dr. GRPO takes the generation budget, --rollout.max_tokens)")  # fmt: skip
        check(min(self.overlong_buffer, self.overlong_max_len) >= 0, "algo.overlong_buffer", "must be >= 0")
        check_bounds(self, overlong_coef="> 0", entropy_coef=">= 0 (0 = no entropy bonus)")
        check(0 <= self.is_low <= 1 <= self.is_high, "algo.is_low", "the IS band needs 0 <= is_low <= 1 <= is_high")
        modes = algo.level_modes(self.is_level) if self.is_level != "none" else (self.is_mode,)
        geo = " (a geometric mean is a filter statistic, not a weight)" if self.is_level == "geo" else ""
        check(self.is_mode in modes, "algo.is_mode", f"--algo.is_level {self.is_level} takes only mode "
              f"{' or '.join(modes)}{geo}, not {self.is_mode!r}; add --algo.is_mode {modes[0]}")  # fmt: skip
        check(self.kl_estimator != "k1" or not (self.kl_coef or self.kl_target), "algo.kl_estimator", "k1 cannot be "
              "the KL loss: its expected gradient is 0 (E[grad log pi] = 0), so the term would do nothing while "
              "train/kl moves; use k2 (its expected gradient is KL(policy || ref)'s) or k3 "
              "(KL(ref || policy)'s)")  # fmt: skip
        try:
            self.objective()
        except ValueError as e:
            raise ConfigError(f"algo: {e}") from None
        for key, reason in self.inert_settings():
            raise ConfigError(f"algo.{key}: has no effect here: {reason}")

    def inert_settings(self) -> list[tuple[str, str]]:
        """(field, why) for each field set away from its default where it cannot change training (no silent no-ops;
        tests/train/test_no_silent_noops.py checks every other change moves the loss or the update)."""
        out: list[tuple[str, str]] = []

        def inert(reason: str, *keys: str) -> None:
            out.extend((k, reason) for k in changed(self, *keys))

        one_step = (
            "molt train takes one optimizer step per batch against the proximal policy = the current weights, so "
            "the ratio is exactly 1: the PPO clip never binds and every surrogate has the same gradient (stale "
            "tokens are corrected by --algo.is_level/is_mode/is_low/is_high)"
        )
        from molt import algo

        if algo.POLICY_LOSSES.info(self.policy_loss).get("pg_at_ratio_one"):  # a loss of your own may differ there
            inert(one_step, "policy_loss", "clip_low", "clip_high", "dual_clip")
        if self.is_level == "none":
            inert("--algo.is_level none turns the IS correction off", "is_mode", "is_low", "is_high")
        elif self.is_mode == "trunc":
            inert("is_low bounds mask and clip; --algo.is_mode trunc only caps at is_high", "is_low")
        if not self.kl_coef:
            inert("the KL loss is off (--algo.kl_coef 0)", "kl_estimator", "kl_target")
        if not self.kl_target:
            inert("the KL coefficient is fixed (--algo.kl_target 0)", "kl_horizon")
        if not self.teacher:
            inert("there is no teacher (--algo.teacher)", "teacher_coef")
        if not self.overlong_buffer:
            inert("the overlong penalty is off (--algo.overlong_buffer 0)", "overlong_max_len", "overlong_coef")
        if not algo.AGGREGATIONS.info(self.loss_agg).get("needs_norm_len"):
            inert(f"--algo.loss_agg {self.loss_agg} divides by no constant (seq-mean-token-sum-norm does)", "norm_len")
        return out

    def needs(self, field: str) -> bool:
        """Whether the estimator reads `AdvantageInputs.<field>` (its registered `needs`): `values_bt` makes the run
        train a critic, `kl_bt` gives it the per-token reverse KL to the teacher."""
        from molt.algo import ESTIMATORS

        return field in ESTIMATORS.info(self.estimator)["needs"]

    def objective(self):
        """The algo library's ObjectiveParams for these settings."""
        from molt import algo

        level = None if self.is_level == "none" else self.is_level
        return algo.ObjectiveParams(
            policy_loss=self.policy_loss,
            loss_agg=self.loss_agg,
            surrogate=algo.SurrogateParams(self.clip_low, self.clip_high, self.dual_clip or None),
            is_correction=algo.ISCorrectionParams(level, self.is_mode, self.is_low, self.is_high),
            kl_estimator=self.kl_estimator,
            kl_loss_coef=self.kl_coef,
            entropy_coef=self.entropy_coef,
            norm_len=self.norm_len or None,
        )


@dataclass
class CriticConfig:
    """The PPO critic (value model) that `--algo.estimator gae` trains beside the policy (docs/algorithms.md)."""

    path: str = ""
    """HF model folder the critic's body starts from (same tokenizer). Default: a copy of the initial policy."""
    lr: float = 0.0
    """Critic learning rate (0 = train.lr), with the policy's warm-up and cosine decay."""
    clip: float = 0.2
    """Value clip: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, +-clip) - R)^2); 0 = unclipped. V_old are the
    values before the step's first critic update (those GAE used), so it binds with critic.updates > 1."""
    updates: int = 1
    """Critic optimizer steps per batch, on the same returns (the policy still takes one)."""

    def __post_init__(self) -> None:
        check_finite(self, "critic")
        check(self.lr >= 0 and self.clip >= 0, "critic.lr", "critic.lr and critic.clip must be >= 0")
        check(self.updates >= 1, "critic.updates", "must be >= 1")
        check(self.updates > 1 or not changed(self, "clip"), "critic.clip", "has no effect here: with one critic "
              "update per batch V = V_old, so the clip never binds; add --critic.updates 2 or more")  # fmt: skip
        run = bool(self.path) and os.path.isdir(os.path.join(self.path, "checkpoints"))
        run = run and not os.path.isdir(os.path.join(self.path, "checkpoint"))  # a finished `molt sft` run: its model
        check(not run, "critic.path", f"{self.path} is a `molt train` run (or an unfinished `molt sft` one): its "
              "checkpoints hold the policy, and the critic it trained lives in their trainer_state.pt, for --resume; "
              "give the critic's model folder (or a checkpoint folder, for a body that starts as that "
              "policy)")  # fmt: skip
        self.path = self.path and check_model_folder(self.path, "critic.path")


def check_filter_names(rollout: RolloutConfig) -> None:
    """`rollout.filters` name registered filters; checked by `Config` once `algo.plugins` registered their own."""
    from molt.algo.filtering import GROUP_FILTERS

    unknown = [f for f in rollout.filters if f not in GROUP_FILTERS and f != "auto"]
    check(not unknown, "rollout.filters", f"unknown {unknown}; choose from auto, {GROUP_FILTERS.names()}{OWN}")


def check_rollout_algo(rollout: RolloutConfig, algo: AlgoConfig) -> None:
    """Checks across the rollout and algo groups: truncated sampling (top-p / top-k) needs the IS correction, an
    estimator that reads no reward (on_policy_distill) takes no reward filter, and one sample per prompt must leave
    a signal (no all-equal filter, which drops every group of one; an estimator whose group of one is not 0), and
    RL samples (temperature > 0: its log-probs need a distribution)."""
    check(rollout.temperature >= 1e-4, "rollout.temperature", "must be >= 1e-4 for RL (log-probs need sampling; "
          "0, greedy, is for molt serve)")  # fmt: skip
    for key, truncates in (("top_p", rollout.top_p < 1), ("top_k", rollout.top_k > 0)):
        check(algo.is_level != "none" or not truncates, f"rollout.{key}", "samples from a truncated distribution "
              "the trainer's full-vocabulary log-probs do not see: enable the IS correction (--algo.is_level token, "
              "seq or geo), which corrects for it, or sample without it")  # fmt: skip
    import torch

    from molt.algo import ESTIMATORS, AdvantageInputs, compute_advantages

    if rollout.n_samples_per_prompt == 1:
        info = ESTIMATORS.info(algo.estimator)
        if info["group_baseline"] and {*info["needs"]} <= {"rewards_b", "group_ids_b"}:  # two groups of one: 1, 0
            probe = AdvantageInputs(torch.ones(2, 1), torch.tensor([1.0, 0.0]), torch.tensor([0, 1]))
            check(bool(compute_advantages(algo.estimator, probe)[0].any()), "rollout.n_samples_per_prompt", "1 "
                  f"gives every rollout advantage 0 with --algo.estimator {algo.estimator}, which compares it with the "
                  "others of its prompt: sample 2 or more (rloo and reinforce learn from one)")  # fmt: skip
        check("all-equal" not in rollout.group_filters(algo.estimator), "rollout.n_samples_per_prompt", "1 makes "
              "every group all-equal, which the all-equal filter of rollout.filters drops (auto has it for a group "
              "estimator): sample 2 or more, or set --rollout.filters nonfinite")  # fmt: skip
    if "rewards_b" not in ESTIMATORS.info(algo.estimator)["needs"]:
        for name in (f for f in rollout.group_filters(algo.estimator) if f in ("all-equal", "score-range")):
            raise ConfigError(
                f"rollout.filters: {name} reads the reward, which --algo.estimator {algo.estimator} never uses: it "
                "would drop groups that carry signal; use --rollout.filters nonfinite"
            )
