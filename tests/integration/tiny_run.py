"""The config of a two-step async RL run on a tiny model, shared by the end-to-end tests."""

from asyncrl.config import ExperimentConfig, load_config


def tiny_run_config(tmp_path, model, *overrides: str, name: str = "e2e") -> ExperimentConfig:
    """2 steps of 2 prompts x 2 samples of <= 12 tokens, float32, one core each.

    The toy reward differs between almost any two completions, so GRPO has signal on a
    random model. `overrides` come last and win.
    """
    return load_config(None, tiny_run_overrides(tmp_path, model, *overrides, name=name))


def tiny_run_overrides(tmp_path, model, *overrides: str, name: str = "e2e") -> list[str]:
    """`tiny_run_config`'s overrides, e.g. for `asyncrl train` in a subprocess."""
    return [
        f"experiment_name={name}", f"cluster.fileroot={tmp_path / 'runs'}",
        f"actor.path={model}", "actor.dtype=float32", "actor.optimizer.lr=1e-3",
        "local_engine.dtype=float32", "local_engine.max_batch_size=16",
        "local_engine.max_seq_len=256", "gconfig.n_samples=2", "gconfig.max_new_tokens=12",
        "train_dataset.path=reasoning_gym:basic_arithmetic", "train_dataset.size=64",
        "train_dataset.batch_size=2", "rollout.consumer_batch_size=2",
        "rollout.max_head_offpolicyness=1", "total_train_steps=2",
        "workflow.reward_fn=toy_rewards:text_hash", "stats_logger.progress_bar=false",
        "stats_logger.plot=false", "evaluator.before_training=false",
        "evaluator.after_training=false",
        "scheduler.inference_threads=1", "scheduler.trainer_threads=1", *overrides,
    ]
