"""The asynchronous RL loop, its accounting, evaluation, checkpoints and rollout dumps (`molt train` is in molt/cli)."""
