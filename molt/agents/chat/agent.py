"""`ChatAgent`: an ordinary async program that drives the policy through the OpenAI or Anthropic SDK.

`ChatRunner` owns one chat server per runner process (started on first use, on the running loop) and
turns one `ChatAgent.run(ctx)` (within `step_timeout_s x max_turns` of its own time: its model calls do not count)
into its session's trajectory segments, each stamped with the rollout's reward, score, ids and segment index.
The agent must use async clients (`AsyncOpenAI`, `AsyncAnthropic`) or run sync ones in a thread: the server shares
its event loop (one blocked past `step_timeout_s` stops the run: `watchdog.LoopWatchdog`)."""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from molt.agents.chat.clients import ClientPool
from molt.agents.chat.server import ChatServer
from molt.agents.env import Env, Messages, Result, load_agent, prompt_messages
from molt.agents.runner import ContextBudgetDrop, EpisodeLimits, check_result, run_episode
from molt.agents.watchdog import watch_loop, within
from molt.config import ConfigError
from molt.data.trajectory import Trajectory
from molt.errors import AgentExit, error_message
from molt.models.vision import image_data_uri
from molt.user_code import import_failure

# `chat` config fields that are ChatServer options in training (the rest only apply to `molt serve`)
CHAT_SERVER_OPTIONS = ("host", "port", "model_name", "model_aliases", "max_body_bytes", "tool_parser", "render_tools")


@dataclass
class ChatContext:
    """What a ChatAgent run gets: where its session lives, and the dataset row."""

    base_url: str  # OpenAI SDK base_url (ends in /v1)
    session_url: str  # Anthropic SDK base_url (the SDK appends /v1/messages)
    api_key: str
    model: str
    messages: Messages  # the row's prompt as OpenAI chat messages (images: `image_url` parts with data URIs)
    tools: list[dict[str, Any]] | None  # OpenAI function schemas from the row
    label: Any  # the row's reference answer: its `answer` column, else `label` (as the built-in rewards read it)
    row: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)  # the rollout's settings (the server applies them)
    limits: EpisodeLimits = field(default_factory=EpisodeLimits)
    session_id: str = ""
    clients: ClientPool = field(default_factory=ClientPool, repr=False)  # the runner's (built by hand: its own)

    def openai(self, **options: Any) -> Any:
        """An `AsyncOpenAI` client bound to this session, on the runner's shared connection pool; `options` go to
        the constructor (e.g. `max_retries`); closing it (`async with`) keeps the pool open."""
        return self.clients.client("openai", self.base_url, self.api_key, self.session_id, **options)

    def anthropic(self, **options: Any) -> Any:
        """An `AsyncAnthropic` client bound to this session, on the runner's shared connection pool."""
        return self.clients.client("anthropic", self.session_url, self.api_key, self.session_id, **options)


class ChatAgent:
    """Base class of chat agents: override `async run(ctx) -> Result`.

    Every completion request on `ctx.base_url` / `ctx.session_url` is recorded token-exactly; the
    returned `Result.reward` (and `score`, `info`, `truncated`) applies to all recorded segments."""

    async def run(self, ctx: ChatContext) -> Result:
        raise NotImplementedError


def load_agent_class(spec: str) -> type:
    """`file.py[:Name]` or `pkg.module[:Name]`: the one Env or ChatAgent subclass it defines (or `Agent`).

    Checked before any model is built: the module imports, the class exists, overrides `async step` (an
    Env) or `async run` (a ChatAgent) and takes no constructor arguments. Any problem is a ConfigError
    naming `rollout.agent` (and the file's line when importing it failed). A file is imported once per version; a
    module's class (`__main__:MyAgent` in a notebook) is looked up each time (a cell may redefine it)."""
    path = Path(spec.split(":")[0])
    if path.suffix == ".py" and path.exists():
        return _file_agent_class(spec, path.stat().st_mtime)
    return _checked_agent_class(spec)


@functools.cache
def _file_agent_class(spec: str, mtime: float) -> type:
    return _checked_agent_class(spec)


def _checked_agent_class(spec: str) -> type:
    try:
        cls = load_agent(spec, bases=(Env, ChatAgent))
    except Exception as e:  # noqa: BLE001 - the user's module failed to import, or names nothing usable
        raise _import_error(spec, e) from None
    name = getattr(cls, "__name__", repr(cls))
    if not isinstance(cls, type):
        raise ConfigError(f"rollout.agent: {spec!r} names {name}, which is not a class (an Env or ChatAgent subclass)")
    method = "run" if issubclass(cls, ChatAgent) else "step"
    own = getattr(cls, method, None)
    if not issubclass(cls, (Env, ChatAgent)) and not (callable(own) and hasattr(cls, "reset")):
        raise ConfigError(f"rollout.agent: {name} is not an Env or ChatAgent (from molt.agents import Env, Result)")
    if own in (Env.step, ChatAgent.run):
        raise ConfigError(f"rollout.agent: {name} does not define `async def {method}(...)` (it must return a Result)")
    if not inspect.iscoroutinefunction(own):
        raise ConfigError(f"rollout.agent: {name}.{method} must be `async def {method}(...)` (it is awaited)")
    if method == "step":  # an Env's calls: reset(row) then step(action), each awaited
        if not inspect.iscoroutinefunction(cls.reset):
            raise ConfigError(f"rollout.agent: {name}.reset must be `async def reset(self, row)` (it is awaited)")
        for fn, call in ((cls.reset, "reset(self, row)"), (own, "step(self, action)")):
            try:
                inspect.signature(fn).bind(None, None)
            except TypeError:
                raise ConfigError(f"rollout.agent: {name}.{fn.__name__} must take one argument: `{call}`") from None
            except ValueError:  # no signature to inspect: trust it
                pass
    try:
        inspect.signature(cls).bind()
    except TypeError:
        raise ConfigError(f"rollout.agent: {name}() must take no arguments (Molt builds one per episode)") from None
    except ValueError:  # no signature to inspect: trust it
        pass
    return cls


def _import_error(spec: str, error: Exception) -> ConfigError:
    """A one-line ConfigError for a failed agent import, located at the agent file's line where it can be."""
    text = str(error)
    if text.startswith("--rollout.agent: "):  # load_agent's own messages (missing file, class, attribute)
        return ConfigError("rollout.agent: " + text.removeprefix("--rollout.agent: "))
    return ConfigError(f"rollout.agent: {import_failure(spec, error)}")


class ChatRunner:
    """Runs ChatAgent episodes through one lazily started chat server."""

    def __init__(self, engine, tokenizer, api_key: str = "", **server_options: Any):
        self.engine, self.tokenizer = engine, tokenizer
        self.api_key = api_key or secrets.token_urlsafe(16)  # a training server always checks a key
        self.server_options = server_options
        self._server: asyncio.Task | None = None
        self.clients = ClientPool()

    async def server(self) -> ChatServer:
        if self._server is None:
            server = ChatServer(self.engine, self.tokenizer, api_key=self.api_key, **self.server_options)
            self._server = asyncio.ensure_future(server.start())
            self.clients.app = server  # ctx.openai() / ctx.anthropic(): in-process on this loop
        return await self._server

    async def close(self) -> None:
        await self.clients.close()
        task, self._server = self._server, None
        if task is None:
            return
        try:
            server = await task
        except Exception:  # noqa: BLE001 - it never started; the rollouts already reported why
            return
        await server.stop()

    async def run(
        self, agent: ChatAgent, row: dict[str, Any], sampling, limits: EpisodeLimits, keep_ids: bool = False, **ids: int
    ) -> list[Trajectory]:
        """One ChatAgent rollout -> its segments (sharing reward and ids); raises if it made no request."""
        server = await self.server()
        session = server.open_session(sampling, max_len=limits.max_len, max_turns=limits.max_turns, keep_ids=keep_ids)
        url = f"{server.url}/s/{session.id}"
        ctx = ChatContext(
            base_url=url + "/v1",
            session_url=url,
            api_key=self.api_key,
            model=server.model_name,
            messages=wire_messages(prompt_messages(row["messages"])),  # a trailing assistant turn: an SFT answer
            tools=row.get("tools"),
            label=next((row[k] for k in ("answer", "label") if row.get(k) is not None), None),
            row=row,
            sampling={"temperature": sampling.temperature, "top_p": sampling.top_p, "max_tokens": sampling.max_tokens},
            limits=limits,
            session_id=session.id,
            clients=self.clients,
        )
        name, budget_s = type(agent).__name__, limits.step_timeout_s * limits.max_turns

        def hold(scope: asyncio.Timeout) -> None:
            session.budget = scope  # stopped while its model calls generate

        try:
            result = await within(budget_s, agent.run(ctx), f"{name}.run", "rollout.step_timeout_s x max_turns", hold)
        finally:
            segments = server.close_session(session.id)
        result = check_result(result, f"{name}.run")
        rescore = getattr(agent, "rescore", None)  # a reward function scoring the final answer (reward_env.py)
        if rescore is not None and segments:
            answer = last_completion_text(self.tokenizer, segments[-1])
            result = await within(limits.step_timeout_s, rescore(result, answer, row), "the reward function")
            result = check_result(result, "the reward function")
        return _stamp(name, result, segments, session.truncated, ids)


def wire_messages(messages: Messages) -> Messages:
    """`messages` with Molt's `{"type": "image", "image": X}` parts as OpenAI `image_url` parts (data URIs), which
    both chat wires accept (an unusable image is an ImageError: the rollout fails)."""

    def part(p: Any) -> Any:
        if not (isinstance(p, dict) and p.get("type") == "image"):
            return p
        return {"type": "image_url", "image_url": {"url": image_data_uri(p.get("image"))}}

    return [m | {"content": [part(p) for p in m["content"]]} if isinstance(m.get("content"), list) else m
            for m in messages]  # fmt: skip


def last_completion_text(tokenizer, segment: Trajectory) -> str:
    """Decoded text of the last completion the engine generated in `segment` ("" if none)."""
    if not segment.actions:
        return ""
    start, end = segment.actions[-1][:2]
    return tokenizer.decode(segment.tokens[start:end], skip_special_tokens=True)


def _stamp(name: str, result: Result, segments: list[Trajectory], truncated: bool, ids: dict) -> list:
    """`segments` stamped with the checked `result`'s reward, score and info, the ids and segment indices."""
    if not segments and truncated:
        msg = f"{name}.run: no request fit the context budget (rollout.max_len); nothing was generated"
        raise ContextBudgetDrop(msg)  # dropped and counted (drop/prompt_over_context), as with the built-in Env
    if not segments:
        raise RuntimeError(f"{name}.run made no completion request on its session (nothing to train)")
    score = result.score if result.score is not None else result.reward
    for i, seg in enumerate(segments):
        seg.reward, seg.score, seg.info = result.reward, score, dict(result.info)
        seg.segment, seg.num_segments = i, len(segments)
        seg.group_id, seg.rollout_id = ids.get("group_id", 0), ids.get("rollout_id", 0)
        seg.check()
    segments[-1].truncated |= bool(result.truncated) or truncated
    return segments


def _fresh(value: Any) -> Any:
    """`value` with its dicts, lists and sets copied at every depth (strings, numbers, images shared)."""
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    return type(value)(_fresh(v) for v in value) if isinstance(value, list | set) else value


def _exit_message(error: BaseException) -> str:
    """What agent code raised that would end more than its rollout."""
    if isinstance(error, SystemExit):
        return f"agent code called sys.exit({error.code!r})"
    if isinstance(error, asyncio.CancelledError):
        return "agent code raised asyncio.CancelledError, but its rollout was not cancelled"
    message = error_message(error)
    return f"agent code raised {type(error).__name__}{f': {message}' if message else ''}, which is not an Exception"


async def _construct(make_env: Callable[[], Any]) -> Any:
    return make_env()


def local_rollout(
    chat: ChatRunner | None, engine, tokenizer, make_env: Callable[[], Any], interrupts_ignored: bool = False
):
    """`rollout(row, sampling, limits, **ids)` on this event loop, a fresh agent from `make_env()` each time, on its own
    copy of the row, nested columns and messages included (the samples of a group share one row: an agent or reward
    that changes its row must not change the others', later epochs' or the eval's); agent code blocking the loop
    past `limits.step_timeout_s` stops the run (`watchdog.LoopWatchdog`). A `BaseException` of agent code fails its
    rollout as `AgentExit`, but a `KeyboardInterrupt` stops the run unless `interrupts_ignored` (an agent worker,
    which ignores SIGINT: there it can only be the agent's own)."""

    armed = False  # the run's first rollout arms the loop's watchdog for this run

    async def rollout(row: dict, sampling, limits: EpisodeLimits, **kw) -> list[Trajectory]:
        nonlocal armed
        watch_loop(limits.step_timeout_s, new_run=not armed)
        armed = True
        row = copy.copy(row)  # keeps a LocatedRow's file:line
        row.update(_fresh(dict(row)))
        try:
            # an Env: one segment; a ChatAgent: one or more, through `chat`. Its constructor is agent code: a blocking
            # one (a sync connection to a sandbox) is caught by the watchdog, as a blocking step is
            agent = await within(limits.step_timeout_s, _construct(make_env), "the agent's constructor")
            if isinstance(agent, ChatAgent):
                return await chat.run(agent, row, sampling, limits, **kw)
            return [await run_episode(engine, tokenizer, agent, row, sampling, limits, **kw)]
        except Exception:
            raise
        except BaseException as e:  # would end more than this rollout: the run's process, or (in a worker) hang it
            interrupted = isinstance(e, KeyboardInterrupt) and not interrupts_ignored  # else the agent's own
            if isinstance(e, GeneratorExit) or interrupted or asyncio.current_task().cancelling():
                raise  # closed, interrupted (Ctrl-C, or SIGTERM where SIGINT is ignored) or cancelled: pass it on
            raise AgentExit(_exit_message(e)).with_traceback(e.__traceback__) from None

    return rollout
