"""`asyncrl sft` with allocation_mode fsdp:d<N>: the launcher starts N ranks under the local
scheduler, and two ranks train exactly what one does."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from asyncrl import cli
from asyncrl.config import ConfigError, load_config
from asyncrl.config.offline import SFTConfig
from asyncrl.models.tiny import make_tiny_model
from asyncrl.observe import read_stats
from asyncrl.offline import launch as offline_launch
from asyncrl.offline.loop import OfflineTrainer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", arch="llama")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "count.jsonl"
    rows = [{"prompt": f"Count to {n}", "answer": " ".join(str(i) for i in range(1, n + 1))}
            for n in range(2, 10)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def sft_args(tmp_path, model, data, name, allocation):
    # 4 rows of about 30-45 tokens a step, micro-batches of at most 80 padded tokens: one
    # rank runs 3 or 4 micro-batches a step, so two ranks each compute part of every step.
    return ["sft", f"experiment_name={name}", f"allocation_mode={allocation}",
            f"cluster.fileroot={tmp_path / 'runs'}", f"model.path={model}",
            "model.dtype=float32", "model.mb_spec.max_tokens_per_mb=80",
            "model.optimizer.lr=1e-3", f"train_dataset.path={data}",
            "train_dataset.batch_size=4", "total_train_steps=2", f"valid_dataset.path={data}",
            "valid_dataset.shuffle=false", "stats_logger.progress_bar=false",
            "stats_logger.tensorboard=false", "scheduler.trainer_threads=1"]


def test_two_ranks_train_what_one_rank_trains(tmp_path, tiny_model, data):
    assert cli.main(sft_args(tmp_path, tiny_model, data, "one", "fsdp:d1")) == 0
    assert cli.main(sft_args(tmp_path, tiny_model, data, "two", "fsdp:d2")) == 0
    one, two = tmp_path / "runs" / "one" / "trial0", tmp_path / "runs" / "two" / "trial0"
    reports = [json.loads((two / "ranks" / f"{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["ok"]) for r in reports] == [(0, True), (1, True)]
    assert (two / "logs" / "trainer-1.log").is_file()

    rows_one, rows_two = read_stats(one / "stats.jsonl"), read_stats(two / "stats.jsonl")
    assert [r["kind"] for r in rows_two] == ["eval", "train", "train", "eval"]
    train_one = [r for r in rows_one if r["kind"] == "train"]
    train_two = [r for r in rows_two if r["kind"] == "train"]
    print("per-step loss, 1 rank :", [r["train/loss"] for r in train_one])
    print("per-step loss, 2 ranks:", [r["train/loss"] for r in train_two])
    # Each rank ran part of every step's micro-batches (one rank: 3, then 4).
    assert all(b["train/n_mbs"] < a["train/n_mbs"] for a, b in zip(train_one, train_two))
    # The same micro-batch losses and gradients, summed in another order (over ranks):
    # observed, step 1's loss is bit-identical, step 2's and the gradient norms differ by
    # up to 3e-7 relative (fp32 rounding in differently shaped matmuls), so rel=1e-5 leaves
    # room for other CPUs' kernels. A wrong reduction shows far above it: a mean over 2
    # ranks halves grad_norm (Adam and the clipping would hide it in the weights), a rank
    # on the wrong rows changes the losses by percents.
    for a, b in zip(rows_one, rows_two):
        for key in ("train/loss", "train/grad_norm", "eval/loss"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)
    w_one = load_file(one / "checkpoints" / "step2" / "model.safetensors")
    w_two = load_file(two / "checkpoints" / "step2" / "model.safetensors")
    assert w_one.keys() == w_two.keys()
    print("largest weight difference after 2 steps:",
          max(float((w_one[k] - w_two[k]).abs().max()) for k in w_one))
    # Observed at most 6e-8: one rounding of a weight near 1 (the norms'), where fp32's
    # spacing is 1.2e-7. Adam's steps are lr = 1e-3 per weight, so 1e-6 (a few spacings)
    # separates rounding from any real difference in the updates.
    for name in w_one:
        torch.testing.assert_close(w_two[name], w_one[name], atol=1e-6, rtol=0)


def test_a_failing_rank_stops_the_run_naming_it_with_its_log(tmp_path, tiny_model, data,
                                                             monkeypatch, capsys):
    missing = tmp_path / "missing.jsonl"
    real_spec = offline_launch.rank_spec

    def rank1_reads_a_missing_file(*args, **kwargs):
        spec = real_spec(*args, **kwargs)
        spec.worker_args = [[], [f"train_dataset.path={missing}"]]  # overrides after --config
        return spec

    monkeypatch.setattr(offline_launch, "rank_spec", rank1_reads_a_missing_file)
    assert cli.main(sft_args(tmp_path, tiny_model, data, "fail", "fsdp:d2")) == 1
    err = capsys.readouterr().err
    assert "trainer rank 1 of 2 failed" in err
    assert str(missing) in err  # the error, and the log's tail with the traceback
    assert "trainer-1.log" in err


def test_an_inference_part_in_allocation_mode_is_a_config_error(capsys):
    assert cli.main(["sft", "train_dataset.path=x", "allocation_mode=vllm:d4+fsdp:d4"]) == 2
    err = capsys.readouterr().err
    assert "config error: allocation_mode='vllm:d4+fsdp:d4' has an inference part" in err


def test_one_process_refuses_an_allocation_of_two_ranks(tmp_path, tiny_model, data):
    cfg = load_config(None, sft_args(tmp_path, tiny_model, data, "alone", "fsdp:d2")[1:],
                      schema=SFTConfig)
    with pytest.raises(ConfigError, match="asks for 2 trainer ranks but this process group "
                                          "has 1; start the run with `asyncrl sft"):
        OfflineTrainer(cfg)


def test_rank_spec_splits_cores_on_cpu_and_leaves_gpus_to_local_rank(monkeypatch):
    monkeypatch.setattr(offline_launch.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    cfg = load_config(None, ["train_dataset.path=x", "allocation_mode=fsdp:d2"],
                      schema=SFTConfig)
    spec = offline_launch.rank_spec("dpo", cfg, Path("run/config.yaml"), Path("run/ranks"))
    assert spec.command[-4:] == ["asyncrl.cli", "dpo", "--config", "run/config.yaml"]
    assert (spec.count, spec.torch_distributed, spec.health_path) == (2, True, None)
    assert spec.cores == [[0, 1], [2, 3]] and spec.cpus == 2 and spec.gpu_ids is None
    assert spec.env[offline_launch.REPORTS_ENV] == "run/ranks"

    cfg = load_config(None, ["train_dataset.path=x", "allocation_mode=fsdp:d8",
                             "cluster.n_gpus_per_node=8", "scheduler.trainer_threads=3"],
                      schema=SFTConfig)
    spec = offline_launch.rank_spec("sft", cfg, Path("c.yaml"), Path("r"))
    # Each rank sees the node's GPUs (CUDA_VISIBLE_DEVICES untouched) and takes LOCAL_RANK's.
    assert spec.gpus == 1 and spec.gpu_ids == [[]] * 8
    assert spec.cores is None and spec.cpus == 3  # the scheduler hands out 3 cores a rank


def test_only_a_process_outside_torchrun_launches(monkeypatch):
    cfg = load_config(None, ["train_dataset.path=x", "allocation_mode=fsdp:d2"],
                      schema=SFTConfig)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert offline_launch.is_launcher(cfg)
    monkeypatch.setenv("RANK", "0")
    assert not offline_launch.is_launcher(cfg)
    single = load_config(None, ["train_dataset.path=x"], schema=SFTConfig)
    monkeypatch.delenv("RANK")
    assert not offline_launch.is_launcher(single)


def test_a_last_batch_smaller_than_the_ranks_is_refused_before_training(monkeypatch):
    monkeypatch.setattr("asyncrl.offline.loop.dist.get_world_size", lambda: 4)
    OfflineTrainer._check_batches_split([[]] * 10, 5, "train_dataset")  # 5 + 5: fine
    with pytest.raises(ConfigError, match="train_dataset: 10 examples in batches of 8 leave a "
                                          "last batch of 2, fewer than the 4 ranks"):
        OfflineTrainer._check_batches_split([[]] * 10, 8, "train_dataset")
    with pytest.raises(ConfigError, match="valid_dataset: 3 examples .* last batch of 3"):
        OfflineTrainer._check_batches_split([[]] * 3, 8, "valid_dataset")
