"""Rollout engines behind one async interface: the built-in torch engine, a vLLM adapter, a router.

`engine` knows models, not agents or trainers. See docs/engine.md."""

from molt.engine.cache import Move, SlotCacheManager
from molt.engine.interface import Completion, ContextLengthError, Engine, SamplingParams
from molt.engine.torch_engine import TorchEngine

__all__ = [
    "Completion",
    "ContextLengthError",
    "Engine",
    "Move",
    "SamplingParams",
    "SlotCacheManager",
    "TorchEngine",
]
