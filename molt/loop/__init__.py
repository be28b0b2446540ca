"""The asynchronous RL loop, its evaluation and checkpoints, and the `molt train` command."""
