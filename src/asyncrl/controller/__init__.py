"""The RL controller: the loop of the asynchronous PPO family (rl.py), the rollout that
feeds it (rollout/, workflows/), weight publication (versions.py), restarts of dead
processes (supervise.py), recovery (recover.py), agent episodes (agents.py) and the start
of the run's processes under its scheduler (launch.py)."""
