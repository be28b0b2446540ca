"""The algorithm families' registries use Molt's one `Registry` type (`molt/registry.py`, which imports nothing)."""

from molt.registry import Registry

__all__ = ["Registry"]
