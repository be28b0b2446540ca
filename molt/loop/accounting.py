"""Where every sample goes: the loop's resumable state, a rollout's outcome, and the counts and words for failed
rollouts and dropped groups (`Accounting`, the base of `RLLoop`).

A failed rollout is one warning line; the first failure of each kind goes with its traceback to
`<run_dir>/rollout_failures.log`. Its group trains on unless the estimator needs complete groups. Logged steps say
how many groups were dropped and why; 50 steps' worth dropped in a row stop the run with advice. Knows the config
and trajectories; nothing of engines or the trainer."""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from pathlib import Path

from molt import algo
from molt.config import Config, ConfigError
from molt.data.rows import row_location
from molt.data.trajectory import Trajectory
from molt.errors import RolloutDrop, UserError, describe_error, error_kind, error_traceback

log = logging.getLogger("molt.loop")


@dataclass
class LoopState:
    """Everything a resumed run needs besides weights and optimizer: cursors, counters, buffer."""

    step: int = 0
    next_group: int = 0  # data cursor: index of the next prompt group to start
    restart_groups: list[int] = field(default_factory=list)  # in flight at the checkpoint: rerun first
    drops: dict[str, int] = field(default_factory=lambda: collections.defaultdict(int))
    rollouts: int = 0
    failures: int = 0
    buffer: list[list[dict]] = field(default_factory=list)  # groups not yet trained (serialised)
    elapsed_s: float = 0.0  # the loop's wall clock at the checkpoint (`time/elapsed_s` goes on from it)
    unlogged: list[list] = field(default_factory=list)  # [reward, numeric info] of rollouts no step has logged yet
    data: list = field(default_factory=list)  # [rows, digest] of the training rows the cursor walks (`rows_digest`)


def check_same_rows(then: list, now: list, data) -> None:
    """A resume (`molt train`'s or `molt sft`'s) walks the checkpoint's training rows (`then`, their `rows_digest`;
    empty: not recorded) with its cursor; other rows (`now`) would put other prompts, held-out ones among them, where
    it points, silently: a ConfigError naming the `data` key."""
    if then and then != now:
        key = "data.path" if data.path else "data.task"  # a task's: another Molt may generate others
        raise ConfigError(f"{key}: the training rows changed since the checkpoint ({then[0]} rows then, "
                          f"{now[0]} now, or other rows): its data cursor would pick other prompts, held-out ones "
                          "among them; resume on the run's data, or start a new run from its checkpoint with "
                          "--model.path")  # fmt: skip


@dataclass(frozen=True)
class Sampled:
    """A rollout that ran: its segments (one for an Env; a ChatAgent may rewrite its history into several)."""

    segments: list[Trajectory]


@dataclass(frozen=True)
class Dropped:
    """A rollout that could not run as asked (`RolloutDrop`): its group is dropped under `reason`."""

    reason: str


@dataclass(frozen=True)
class Failed:
    """A rollout whose agent raised or timed out (counted; its group may still train)."""

    error: Exception


RolloutOutcome = Sampled | Dropped | Failed
MAX_DROPPED_ROWS_LOGGED = 20  # data rows named in a warning when their rollouts are dropped
FAILURE_LOG = "rollout_failures.log"  # in the run directory: full tracebacks of the first failure of each kind

DROP_WHY = {  # what a group drop reason means, for the progress lines
    "filter_all_equal": "every sample got the same {signal}: no signal for a group baseline",
    "filter_nonfinite": "a NaN/inf {signal}",
    "filter_score_range": "mean {signal} not inside rollout.score_range",
    "agent_failure": "failed rollouts: all of the group, or any when the estimator needs complete groups",
    "prompt_over_context": "the prompt does not fit rollout.max_len",
    "image_over_context": "an image does not fit rollout.max_len",
    "stale": "older than rollout.max_staleness",
}


def log_failure(failure_log: Path, line: str, error: BaseException, kinds: set) -> bool:
    """Append `line` to `failure_log`, with the traceback if `error` is the first of its kind (added to `kinds`)."""
    first = (kind := error_kind(error)) not in kinds
    kinds.add(kind)
    failure_log.parent.mkdir(parents=True, exist_ok=True)
    with failure_log.open("a") as f:
        f.write(line + "\n" + (error_traceback(error) + "\n" if first else ""))
    return first


class RunStoppedError(UserError, RuntimeError):
    """The run cannot make progress because of the agent, data or settings (not a bug in Molt)."""

    kind = "run stopped"


class AgentFailureRateError(RunStoppedError):
    """More than `rollout.max_failure_frac` of the rollouts failed."""


class Accounting:
    """The counts of failed rollouts and dropped groups, and the lines and errors that explain them."""

    def __init__(self, cfg: Config, state: LoopState, failure_log: Path | None):
        self.cfg, self.state, self.failure_log = cfg, state, failure_log
        info = algo.ESTIMATORS.info(cfg.algo.estimator)
        self.complete_groups = bool(info.get("complete_groups", False))
        # a group baseline needs two rollouts: RLOO would give a lone survivor of failures its raw reward
        self.min_rollouts = 2 if info["group_baseline"] and cfg.rollout.n_samples_per_prompt > 1 else 1
        self.filters = cfg.rollout.group_filters(cfg.algo.estimator)
        self.dropped_in_a_row: collections.Counter[str] = collections.Counter()  # since a group was kept, by reason
        self.group_drops: collections.Counter[str] = collections.Counter()  # since the last drop line
        self.step_dropped_groups = 0  # since the last step's metrics
        self.failure_kinds: set[tuple[str, str]] = set()
        self.drop_details: dict[str, str] = {}  # reason -> the last such drop's message
        self.dropped_rows: set[str] = set()  # rows whose rollouts were dropped (each logged once)
        self.last_failure = ""  # the last failed rollout's error, for the failure-rate stop

    def _count_failure(self, error: Exception, rollout_id: int, group_index: int, row: dict) -> None:
        """One line per failed rollout, naming a data file's row (`file:line`); the first of each kind with its
        traceback in the failure log."""
        self.state.rollouts += 1
        self.state.failures += 1
        what = describe_error(error)
        unless = "all of its rollouts fail" if self.min_rollouts == 1 else "fewer than 2 of its rollouts succeed"
        fate = "its group is dropped: the estimator needs complete groups" if self.complete_groups else (
            f"its group trains without it unless {unless}")  # fmt: skip
        where = row_location(row, "")
        line = f"rollout {rollout_id} (group {group_index}{', ' + where if where else ''}) failed: {what}"
        first = self.failure_log is not None and log_failure(self.failure_log, line, error, self.failure_kinds)
        log.warning("%s; %s%s", line, fate, f" (traceback in {self.failure_log})" if first else "")
        self.last_failure = what
        self._check_failure_rate()

    def _check_failure_rate(self) -> None:
        """Stop once more than `rollout.max_failure_frac` of at least 20 rollouts failed; checked after every rollout,
        so failures early in a run count when the 20th rollout (a success) arrives."""
        ro = self.cfg.rollout
        if self.state.rollouts >= 20 and self.state.failures / self.state.rollouts > ro.max_failure_frac:
            where = f"; tracebacks: {self.failure_log}" if self.failure_log else ""
            raise AgentFailureRateError(
                f"{self.state.failures} of {self.state.rollouts} rollouts failed (rollout.max_failure_frac="
                f"{ro.max_failure_frac}); last error: {self.last_failure}{where}"
            )

    def _count_drop(self, error: RolloutDrop, row: dict) -> Dropped:
        """A rollout that could not run as asked; a data file's row is named (`file:line`), logged once each, at
        most `MAX_DROPPED_ROWS_LOGGED` rows (the progress lines count the rest)."""
        where = row_location(row, "")
        self.drop_details[error.drop_reason] = f"{where}: {error}" if where else str(error)
        if where and where not in self.dropped_rows and len(self.dropped_rows) < MAX_DROPPED_ROWS_LOGGED:
            self.dropped_rows.add(where)
            log.warning("%s: %s; its group is dropped (%s)", where, error, error.drop_reason)
        return Dropped(error.drop_reason)

    def _check_progress(self, reason: str) -> None:
        """Stop with a clear error once 50 steps' worth of groups in a row were dropped (the run cannot train), naming
        every reason they were dropped for, most frequent first."""
        self.dropped_in_a_row[reason] += 1
        if (total := sum(self.dropped_in_a_row.values())) <= 50 * self.cfg.rollout.prompts_per_step:
            return
        whys = [(n, *self._why_stuck(r)) for r, n in self.dropped_in_a_row.most_common()]
        if len(whys) == 1:
            raise RunStoppedError(f"{total} groups in a row were dropped ({whys[0][1]}): {whys[0][2]}")
        parts = "; ".join(f"{n} {what}: {advice}" for n, what, advice in whys)
        raise RunStoppedError(f"{total} groups in a row were dropped: {parts}")

    def _why_stuck(self, reason: str) -> tuple[str, str]:
        """(`reason` with its last drop's message, what to do about it)."""
        ro, signal = self.cfg.rollout, self.cfg.rollout.filter_on
        advice = {
            "prompt_over_context": f"the prompts do not fit rollout.max_len={ro.max_len} tokens (with room to "
            "generate): raise --rollout.max_len or shorten the prompts",
            "image_over_context": f"the images do not fit rollout.max_len={ro.max_len}: raise --rollout.max_len",
            "agent_failure": "rollouts keep failing (see the warnings above)",
            "filter_all_equal": f"every sample of a prompt got the same {signal}: warm-start the model (or use an "
            "easier task), check the reward function, or drop the filter with --rollout.filters nonfinite",
        }.get(reason, f"rollout.filters {list(self.filters)} drop every group; check the {signal}s or the filters")
        detail = f" (last: {self.drop_details[reason]})" if reason in self.drop_details else ""
        return reason + detail, advice

    def drop_line(self) -> str:
        """How many groups were dropped since the last call, and why (empty when none); resets the count."""
        if not self.group_drops:
            return ""
        signal = self.cfg.rollout.filter_on
        parts = [f"{n} {r} ({DROP_WHY.get(r, r).format(signal=signal)})" for r, n in self.group_drops.most_common()]
        total, self.group_drops = sum(self.group_drops.values()), collections.Counter()
        return f"{total} group{'s' * (total != 1)} dropped: " + ", ".join(parts)
