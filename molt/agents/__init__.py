"""Agents: the Env/Result contract, episode runners, built-in environments."""
