"""Training loops: `rl` (the asynchronous PPO family)."""
