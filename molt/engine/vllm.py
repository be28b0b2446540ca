"""The vLLM adapter (optional extra `molt[vllm]`): Molt's engine interface over vLLM's async engine.

Token ids in, token ids and per-token log-probs out (never text that would be re-tokenized).
vLLM is imported lazily, so this module imports without it. Versions and weight sync are done
here, independent of vLLM's internals:

- every generated token records the adapter's `version` when its chunk was produced;
- `interrupt`: in-flight requests are aborted at vLLM's next step (a token boundary), weights are
  swapped, and each request resumes as a new vLLM request whose prompt is prompt + tokens so far
  (vLLM's prefix cache recomputes or reuses the KV); later tokens carry the new version;
- `drain`: new requests wait, in-flight ones finish, then the swap.

Weights reach the workers through `collective_rpc` and `MoltWorkerExtension.molt_load_weights`,
which calls the vLLM model's own `load_weights` with HF-named tensors (Molt names are converted
with `to_hf_state` by the caller). Log-probs are vLLM's (`logprobs_mode`, default "processed_logprobs"
where the installed vLLM supports it); the trainer measures the mismatch (`train/logprob_diff`).
Knows the engine interface and vLLM; nothing of agents or trainers.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from molt.engine.interface import Completion, ContextLengthError, Engine, SamplingParams, SyncMode, Weights


class MoltWorkerExtension:
    """Mixed into vLLM's workers (`worker_extension_cls`): in-place weight loading by RPC."""

    def molt_load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        self.model_runner.model.load_weights(weights=named_tensors)
        return len(named_tensors)


def _vllm_sampling(vllm, sp: SamplingParams, max_tokens: int, min_tokens: int, seed: int | None):
    return vllm.SamplingParams(
        n=1,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k if sp.top_k > 0 else -1,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop_token_ids=list(sp.stop_token_ids),
        stop=list(sp.stop) or None,
        include_stop_str_in_output=True,
        ignore_eos=sp.ignore_eos,
        seed=seed,
        logprobs=0,  # the sampled token's log-prob only
        detokenize=bool(sp.stop),
    )


class VLLMEngine(Engine):
    """Molt's `Engine` over `vllm.AsyncLLMEngine` (one replica; put several behind a `Router`)."""

    def __init__(self, model: str, *, version: int = 0, max_model_len: int = 4096, **engine_args: Any):
        import vllm  # lazy: optional dependency

        self._vllm = vllm
        args = dict(model=model, max_model_len=max_model_len, worker_extension_cls=f"{__name__}.MoltWorkerExtension")
        self._engine = vllm.AsyncLLMEngine.from_engine_args(vllm.AsyncEngineArgs(**(args | engine_args)))
        self.version, self.max_model_len = version, max_model_len
        self._running: dict[str, str] = {}  # our sample id -> current vLLM request id
        self._open = asyncio.Event()
        self._open.set()
        self._interrupted = False

    async def generate_group(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        session_id: str | None = None,
        images=None,
    ) -> list[Completion]:
        if images:
            raise NotImplementedError("the vLLM adapter does not take images yet; use the built-in engine for VLMs")
        sampling = sampling or SamplingParams()
        prompt = [int(t) for t in prompt_token_ids]
        if len(prompt) >= self.max_model_len:
            raise ContextLengthError(f"prompt has {len(prompt)} tokens; max_model_len={self.max_model_len}")
        request_id = request_id or uuid.uuid4().hex
        samples = [self._sample(prompt, sampling, f"{request_id}-{i}", i) for i in range(sampling.n)]
        completions = await asyncio.gather(*samples)
        for c in completions:
            c.request_id = request_id
        return list(completions)

    async def _sample(self, prompt: list[int], sp: SamplingParams, sample_id: str, index: int) -> Completion:
        """One sample; resubmitted as a continuation whenever a weight swap interrupts it."""
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        finish, stop_reason, part = None, None, 0
        while finish is None:
            await self._open.wait()
            vllm_id = f"{sample_id}.{part}"
            self._running[sample_id] = vllm_id
            seed = None if sp.seed is None else sp.seed + 1_000_003 * index + part
            params = _vllm_sampling(
                self._vllm, sp, sp.max_tokens - len(tokens), max(sp.min_tokens - len(tokens), 0), seed
            )
            version, seen, out = self.version, 0, None
            async for out in self._engine.generate({"prompt_token_ids": prompt + tokens}, params, vllm_id):
                sample = out.outputs[0]
                new_ids = list(sample.token_ids[seen:])
                tokens += new_ids
                logprobs += [_sampled_logprob(d, t) for d, t in zip(sample.logprobs[seen:], new_ids, strict=True)]
                versions += [version] * len(new_ids)
                seen = len(sample.token_ids)
            self._running.pop(sample_id, None)
            result = out.outputs[0] if out is not None else None
            reason = result.finish_reason if result is not None else "abort"
            if reason == "abort" and self._interrupted and len(tokens) < sp.max_tokens:
                part += 1
                continue
            finish = "abort" if reason == "abort" else reason
            stop_reason = result.stop_reason if result is not None else None
        return Completion(sample_id, tokens, logprobs, versions, finish, len(prompt), index, stop_reason)

    async def abort(self, request_id: str) -> bool:
        ids = [v for k, v in self._running.items() if k.rsplit("-", 1)[0] == request_id]
        for sample_id in [k for k in self._running if k.rsplit("-", 1)[0] == request_id]:
            self._running.pop(sample_id)
        if ids:
            await self._engine.abort(ids)
        return bool(ids)

    async def update_weights(self, weights: Weights, version: int, mode: SyncMode = "interrupt") -> None:
        named = list(weights.items() if isinstance(weights, Mapping) else weights)
        self._open.clear()  # new requests (and continuations) wait for the swap
        try:
            if mode == "interrupt":
                self._interrupted = True
                await self._engine.abort(list(self._running.values()))
            while self._running:
                await asyncio.sleep(0.005)
            await self._engine.collective_rpc("molt_load_weights", args=(named,))
            await self._engine.reset_prefix_cache()
            self.version = version
        finally:
            self._interrupted = False
            self._open.set()

    async def pause(self) -> None:
        self._open.clear()

    async def resume(self) -> None:
        self._open.set()

    def num_pending(self) -> int:
        return len(self._running)

    async def close(self) -> None:
        self._engine.shutdown()


def _sampled_logprob(position_logprobs: dict | None, token_id: int) -> float:
    if not position_logprobs or token_id not in position_logprobs:
        return float("nan")
    return float(position_logprobs[token_id].logprob)
