"""Molt: reinforcement learning of language-model agents, compact and PyTorch-native."""

__version__ = "0.1.0"
