"""Asynchronous RL end to end on a tiny random model, through real server processes."""

import json
import os
from pathlib import Path

import pytest
from procs import server_pids

from asyncrl.config import load_config
from asyncrl.controller.rl import train
from asyncrl.models.tiny import make_tiny_model
from asyncrl.observe import read_stats
from asyncrl.observe.timeline import read_timeline

pytestmark = pytest.mark.integration


def _config(tmp_path, model, eta, steps, extra=()):
    return load_config(None, [
        "experiment_name=e2e", f"trial_name=eta{eta}", f"cluster.fileroot={tmp_path / 'runs'}",
        f"actor.path={model}", "actor.dtype=float32", "actor.optimizer.lr=1e-3",
        "local_engine.dtype=float32", "local_engine.max_batch_size=16",
        "local_engine.max_seq_len=256",
        "gconfig.n_samples=2", "gconfig.max_new_tokens=12",
        "train_dataset.path=reasoning_gym:basic_arithmetic", "train_dataset.size=64",
        "train_dataset.batch_size=2", "rollout.consumer_batch_size=2",
        f"rollout.max_head_offpolicyness={eta}", f"total_train_steps={steps}",
        "workflow.reward_fn=toy_rewards:text_hash",
        "valid_dataset.path=reasoning_gym:basic_arithmetic", "valid_dataset.size=4",
        "valid_dataset.seed=99", "stats_logger.progress_bar=false",
        "scheduler.inference_threads=1", "scheduler.trainer_threads=1", *extra,
    ])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", arch="llama")


def test_two_async_steps_end_to_end(tmp_path, tiny_model):
    cfg = _config(tmp_path, tiny_model, eta=1, steps=2)
    summary = train(cfg)
    run = Path(summary["run_dir"])
    rows = read_stats(run / "stats.jsonl")
    train_rows = [r for r in rows if r["kind"] == "train"]
    eval_rows = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in train_rows] == [1, 2]
    assert [r["step"] for r in eval_rows] == [0, 2]  # before and after training
    for r in train_rows:
        assert r["rollout/staleness_max"] <= 1
        assert r["perf/trained_tokens"] > 0
        assert r["train/grad_norm"] > 0
    assert (run / "reward_curve.png").stat().st_size > 0
    samples = read_stats(run / "eval" / "step2.jsonl")  # what the model wrote, per item
    assert len(samples) == eval_rows[-1]["eval/n"] and {"question", "completion"} <= set(samples[0])
    assert (run / "weights" / "v2").is_dir()  # the last published version
    assert 0.0 <= summary["eval_before"] <= 1.0 and 0.0 <= summary["eval_after"] <= 1.0
    # The first evaluation starts while the first batch is gathered, and the servers keep
    # the initial weights until it has ended (every token it generated is of version 0).
    spans = read_timeline(run / "timeline.jsonl")
    evals = [s for s in spans if s["lane"] == "evaluator"]
    first_wait = next(s for s in spans if s["lane"] == "trainer" and s["kind"] == "wait")
    assert len(evals) == 2
    assert evals[0]["t0"] < first_wait["t1"]
    assert [(r["eval/version_min"], r["eval/version_max"]) for r in eval_rows] == [(0, 0), (2, 2)]
    assert not server_pids(tiny_model), "an inference server outlived its run"


def test_scheduled_evaluations_read_the_weights_of_their_step(tmp_path, tiny_model):
    # evaluator.freq_steps=1 over 3 steps: before training (0), after steps 1 and 2, and
    # after training (3); each overlaps the next step and must read only its step's weights
    # A second held-out set of another task: both evaluated in one pass, each scored apart.
    summary = train(_config(tmp_path, tiny_model, eta=1, steps=3, extra=[
        "evaluator.freq_steps=1",
        "extra_valid_datasets=[{path: 'reasoning_gym:chain_sum', size: 3, seed: 5}]"]))
    run = Path(summary["run_dir"])
    evals = [r for r in read_stats(run / "stats.jsonl") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 1, 2, 3]
    for r in evals:
        assert (r["eval/n"], r["eval/task/basic_arithmetic/n"], r["eval/task/chain_sum/n"]) == \
            (7, 4, 3)
        assert r["eval/reward"] == pytest.approx(
            (4 * r["eval/task/basic_arithmetic/reward"] + 3 * r["eval/task/chain_sum/reward"]) / 7)
    assert sorted(summary["eval_after_by_task"]) == ["basic_arithmetic", "chain_sum"]
    # the servers stamp each generated token with the version of the weights that made it
    assert [(r["eval/version_min"], r["eval/version_max"]) for r in evals] == [
        (0, 0), (1, 1), (2, 2), (3, 3)]
    assert sorted(p.name for p in (run / "eval").iterdir()) == [
        "step0.jsonl", "step1.jsonl", "step2.jsonl", "step3.jsonl"]
    assert [summary[f"eval_step{s}"] for s in (1, 2)] == [r["eval/reward"] for r in evals[1:3]]
    # each is logged when the load it held back is settled, a step later (the trainer
    # trained on meanwhile): eval 0 after train step 1, eval 1 after step 2, and so on
    order = [(r["kind"], r["step"]) for r in read_stats(run / "stats.jsonl")]
    assert order == [("train", 1), ("eval", 0), ("train", 2), ("eval", 1), ("train", 3),
                     ("eval", 2), ("eval", 3)]


def test_a_reward_that_is_always_zero_is_reported_within_n_plus_one_steps(tmp_path,
                                                                          tiny_model):
    summary = train(_config(tmp_path, tiny_model, eta=1, steps=3, extra=[
        "workflow.reward_fn=toy_rewards:always_zero", "health.steps=2",
        "evaluator.before_training=false", "evaluator.after_training=false"]))
    constant = [f for f in summary["health"] if "every sample got reward 0" in f]
    # it holds from step 1, warns at step 2 (health.steps) and goes on to the last step
    assert len(constant) == 1 and constant[0].startswith("steps 1-3: ")
    assert "One sample: prompt ...'" in constant[0]  # what the model saw and wrote


# Slow: test_trainer_kill_e2e resumes async runs from their checkpoints in `make test`.
@pytest.mark.slow
def test_resume_continues_from_the_checkpoint(tmp_path, tiny_model):
    extra = ["recover.mode=auto", "recover.freq_steps=1", "evaluator.before_training=false",
             "evaluator.after_training=false"]
    train(_config(tmp_path, tiny_model, eta=2, steps=2, extra=extra))
    summary = train(_config(tmp_path, tiny_model, eta=2, steps=3, extra=extra))
    rows = [r for r in read_stats(Path(summary["run_dir"]) / "stats.jsonl") if r["kind"] == "train"]
    # the second run starts at step 3: steps 1-2 come from the first run, appended to
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["rollout/staleness_max"] <= 2
    # rollout.admission=demand on cores shared with the server: one version ahead, before
    # and after the resume (`ahead` is checkpointed), never eta=2
    assert [r["rollout/ahead"] for r in rows] == [1.0, 1.0, 1.0]
    assert os.path.isdir(Path(summary["run_dir"]) / "recover")


def test_demand_admission_stays_one_version_ahead_on_shared_cores(tmp_path, tiny_model):
    # Scoring takes 0.5 s, so the trainer waits for every batch. Off shared cores each wait
    # would take episodes one version further ahead (2 at step 2); on them (the default
    # scheduler here) a wait lends the server the trainer's core, and `ahead` stays 1.
    summary = train(_config(tmp_path, tiny_model, eta=2, steps=3, extra=[
        "workflow.reward_fn=toy_rewards:slow", "evaluator.before_training=false",
        "evaluator.after_training=false"]))
    rows = [r for r in read_stats(Path(summary["run_dir"]) / "stats.jsonl") if r["kind"] == "train"]
    assert [r["rollout/ahead"] for r in rows] == [1.0, 1.0, 1.0]
    assert all(r["perf/wait_batch_s"] > 0.05 for r in rows)  # it did wait, every step


@pytest.mark.slow  # ~30 s; CI covers retries in test_rollout_controller, timeouts in test_rewards
def test_a_hanging_reward_is_timed_out_run_again_and_reported(tmp_path, tiny_model,
                                                              monkeypatch):
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("TOY_REWARD_MARKS", str(marks))
    summary = train(_config(tmp_path, tiny_model, eta=1, steps=3, extra=[
        "workflow.reward_fn=toy_rewards:hangs_once", "workflow.reward_timeout=2",
        "rollout.episode_retries=1", "evaluator.before_training=false",
        "evaluator.after_training=false"]))
    run = Path(summary["run_dir"])
    rows = [r for r in read_stats(run / "stats.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    reports = [json.loads(line) for line in (run / "failures.jsonl").read_text().splitlines()]
    # Items whose first run hung; one may still have been hanging when the run ended.
    hung = len(list(marks.iterdir()))
    assert 1 <= len(reports) <= hung
    assert all(r["retried"] and r["run"] == 1 and "RewardTimeout" in r["error"]
               for r in reports)
    # A step's counters are read when its batch is taken, its reports after it trained.
    assert 1 <= rows[-1]["rollout/episodes_retried"] <= len(reports)
    assert all(r["rollout/episodes_failed"] == 0 for r in rows)


def test_servers_load_while_the_trainer_trains_the_next_step(tmp_path, tiny_model,
                                                              monkeypatch):
    """actor.weight_update_overlap: the load of version v is held until the trainer has
    started step v + 1, which it can (eta=1) only if it does not wait for the load. Were it
    waiting, the held load would give up after 60 s and fail the run."""
    import asyncio
    import time

    from asyncrl.controller.rl import RLTrainer
    from asyncrl.weights import WeightPublisher

    steps, started, loads = 3, [], []
    train_step, load = RLTrainer._train_step, WeightPublisher.load

    def recording_train_step(self, batch):
        started.append(self.versions.version + 1)  # the step it trains
        return train_step(self, batch)

    async def held_load(self, version):
        deadline = time.monotonic() + 60
        while version < steps and version + 1 not in started:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the trainer did not start step {version + 1} while "
                                   f"weights v{version} were loading")
            await asyncio.sleep(0.01)
        loads.append((version, list(started)))
        await load(self, version)

    monkeypatch.setattr(RLTrainer, "_train_step", recording_train_step)
    monkeypatch.setattr(WeightPublisher, "load", held_load)
    summary = train(_config(tmp_path, tiny_model, eta=1, steps=steps, extra=[
        "evaluator.before_training=false", "evaluator.after_training=false"]))
    assert started == [1, 2, 3]
    # v1 loaded while step 2 trained, v2 while step 3; v3 after the last step
    assert loads == [(1, [1, 2]), (2, [1, 2, 3]), (3, [1, 2, 3])]
    rows = [r for r in read_stats(Path(summary["run_dir"]) / "stats.jsonl")
            if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)
    # each load's time is reported by the step that waited for it, the last one's by none
    assert ["perf/weights_load_s" in r for r in rows] == [False, True, True]
    assert (Path(summary["run_dir"]) / "weights" / "v3").is_dir()


def test_without_overlap_each_publish_waits_for_the_load(tmp_path, tiny_model, monkeypatch):
    from asyncrl.controller.rl import RLTrainer
    from asyncrl.controller.versions import VersionSync

    trained, loaded = [], []
    train_step = RLTrainer._train_step
    announce = VersionSync.announce

    def recording_train_step(self, batch):
        trained.append(self.versions.version + 1)
        return train_step(self, batch)

    def recording_announce(self, version):
        loaded.append((version, list(trained)))
        return announce(self, version)

    monkeypatch.setattr(RLTrainer, "_train_step", recording_train_step)
    monkeypatch.setattr(VersionSync, "announce", recording_announce)
    summary = train(_config(tmp_path, tiny_model, eta=1, steps=2, extra=[
        "evaluator.before_training=false", "evaluator.after_training=false",
        "actor.weight_update_overlap=false"]))
    assert loaded == [(1, [1]), (2, [1, 2])]  # announced (loaded) before the next step
    rows = [r for r in read_stats(Path(summary["run_dir"]) / "stats.jsonl")
            if r["kind"] == "train"]
    assert all(r["perf/weights_load_s"] >= 0 for r in rows)
