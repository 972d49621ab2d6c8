"""Training loops: `rl` (the asynchronous PPO family); `sft` and `dpo` on `offline`."""
