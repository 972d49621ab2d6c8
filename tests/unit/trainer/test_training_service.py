"""The training service: batches as safetensors bytes, and 2 service ranks == 1 inline rank."""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from batches import random_batch
from safetensors.torch import load_file

from asyncrl.config import load_config
from asyncrl.config.specfile import write_spec
from asyncrl.controller.specs import build_trainer_spec
from asyncrl.trainer.dist import free_port
from asyncrl.trainer.service import (
    TrainingClient,
    TrainingServiceError,
    decode_batch,
    encode_batch,
)
from asyncrl.trainer.worker import RLWorker


def test_a_batch_round_trips_through_its_bytes_with_unset_fields_left_out():
    tb = random_batch(seed=3)
    tb.rewards = torch.tensor([1.0, 0.0, 0.5, 0.25])
    tb.group_index = torch.tensor([0, 0, 1, 1])
    back = decode_batch(encode_batch(tb))
    for name in ("input_ids", "attention_mask", "loss_mask", "behavior_logprobs", "versions",
                 "rewards", "group_index"):
        original, decoded = getattr(tb, name), getattr(back, name)
        assert decoded.dtype == original.dtype and torch.equal(decoded, original), name
    assert back.advantages is None and back.prox_logprobs is None


def test_a_body_that_is_not_a_batch_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="not a safetensors batch"):
        decode_batch(b"{}")
    from safetensors.torch import save
    with pytest.raises(ValueError, match=r"unknown fields \['labels'\]"):
        decode_batch(save({"labels": torch.zeros(2)}))
    with pytest.raises(ValueError, match="lacks the fields"):
        decode_batch(save({"input_ids": torch.zeros(2, 3, dtype=torch.long)}))


def test_a_batch_file_is_read_from_shared_memory_only():
    from asyncrl.trainer.service import batch_from_request

    tb = random_batch(seed=4)
    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="asyncrl-batch-") as f:
        f.write(encode_batch(tb))
        f.flush()
        back = batch_from_request(json.dumps({"batch_file": f.name}).encode(), "application/json")
    assert torch.equal(back.input_ids, tb.input_ids)
    for bad in ("/etc/passwd", "/dev/shm/other", "/dev/shm/../etc/asyncrl-batch-x"):
        with pytest.raises(ValueError, match="batch_file must be /dev/shm/asyncrl-batch-"):
            batch_from_request(json.dumps({"batch_file": bad}).encode(), "application/json")
    with pytest.raises(ValueError, match="a JSON batch must be"):
        batch_from_request(b'{"path": 1}', "application/json")


def _config(tmp_path, model):
    """GRPO on groups of 2, fp32, a token budget that splits the batch into micro-batches.

    Adam's eps=1 makes the update about lr x gradient: with a small eps, a gradient near 0
    summed in another order (two ranks) may flip the sign of its whole lr-sized step.
    """
    return load_config(None, [
        f"cluster.fileroot={tmp_path}", f"actor.path={model}", "actor.dtype=float32",
        "actor.optimizer.lr=1e-2", "actor.optimizer.eps=1.0",
        "actor.optimizer.gradient_clipping=0",
        "actor.mb_spec.max_tokens_per_mb=14", "gconfig.n_samples=2",
        "actor.reward_norm.group_size=2", "train_dataset.path=unused.jsonl",
    ])


def _batch():
    tb = random_batch(seed=2, lengths=(12, 7, 10, 5, 9, 4))
    tb.rewards = torch.tensor([1.0, 0.0, 0.3, 0.9, 0.5, 0.1])
    tb.behavior_logprobs = -torch.rand(tb.input_ids.shape, generator=torch.Generator().manual_seed(5)) * tb.loss_mask
    return tb


def _start_ranks(spec_path, world_size, **env_extra):
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   **env_extra)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "asyncrl.trainer.service", "--spec", str(spec_path),
             "--port", "0", "--threads", "1"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    addresses = []
    for proc in procs:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                raise RuntimeError(f"training service exited with {proc.returncode}")
            if "listening on " in line:
                addresses.append(line.split("listening on ")[1].strip())
                break
    return procs, addresses


def _stop(procs):
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_two_service_ranks_train_like_one_inline_rank(tiny_path, tmp_path):
    cfg = _config(tmp_path, tiny_path)
    spec_path = write_spec(build_trainer_spec(cfg), tmp_path / "trainer.json")
    procs, addresses = _start_ranks(spec_path, 2)
    try:
        client = TrainingClient(addresses, timeout=120)
        assert client.shared_memory  # both ranks on this host: batches go through /dev/shm
        assert client.initialize(total_steps=3) == {"rank": 0, "world_size": 2}
        two_logprobs = client.compute_logprobs(_batch())
        two = client.train(_batch())
        client.save_hf(str(tmp_path / "two"))
        assert client.info()["steps_done"] == 1
        with pytest.raises(TrainingServiceError, match=r"rank \d: .* 400: bad request: 'path' must be"):
            client.save_state("")
        client.destroy()
    finally:
        _stop(procs)
    assert not list(Path("/dev/shm").glob("asyncrl-batch-*"))  # each removed after its call

    worker = RLWorker(build_trainer_spec(cfg))
    try:
        assert worker.initialize(total_steps=3) == {"rank": 0, "world_size": 1}
        torch.testing.assert_close(two_logprobs, worker.compute_logprobs(_batch()),
                                   atol=1e-6, rtol=1e-6)
        one = worker.train(_batch())
        worker.save_hf(str(tmp_path / "one"))
    finally:
        worker.destroy()
    for key in ("train/loss", "train/grad_norm", "train/n_tokens", "train/clip_frac"):
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
    assert two["train/n_tokens"] == 9 + 4 + 7 + 2 + 6 + 1  # each row's tokens after the 3rd
    saved_two = load_file(tmp_path / "two" / "model.safetensors")
    saved_one = load_file(tmp_path / "one" / "model.safetensors")
    assert saved_two.keys() == saved_one.keys()
    for name, value in saved_one.items():
        torch.testing.assert_close(saved_two[name], value, atol=1e-6, rtol=1e-5)
    assert json.loads((tmp_path / "two" / "config.json").read_text())["model_type"]


def test_a_dead_rank_is_reported_by_rank_within_the_timeout(tiny_path, tmp_path):
    cfg = _config(tmp_path, tiny_path)
    spec_path = write_spec(build_trainer_spec(cfg), tmp_path / "trainer.json")
    procs, addresses = _start_ranks(spec_path, 1)
    _stop(procs)
    client = TrainingClient(addresses, timeout=5)
    t0 = time.monotonic()
    with pytest.raises(TrainingServiceError, match=r"rank 0: trainer http://127.0.0.1:\d+/initialize failed"):
        client.initialize(total_steps=1)
    assert time.monotonic() - t0 < 10


def test_with_an_api_key_every_call_but_health_needs_it(tiny_path, tmp_path):
    spec_path = write_spec(build_trainer_spec(_config(tmp_path, tiny_path)),
                           tmp_path / "trainer.json")
    procs, addresses = _start_ranks(spec_path, 1, ASYNCRL_API_KEY="s3cret")
    try:
        for key in (None, "wrong"):
            with pytest.raises(TrainingServiceError, match="answered 401: missing or wrong API key"):
                TrainingClient(addresses, timeout=30, api_key=key).save_state(str(tmp_path))
        client = TrainingClient(addresses, timeout=30, api_key="s3cret")
        assert client._json_all("/destroy") == {"ok": True}
    finally:
        _stop(procs)


def test_initialising_again_frees_the_old_engines_and_their_process_group(tiny_path, tmp_path):
    """A second initialize (a controller reconnecting to a live rank) replaces the engines;
    the process group goes with the worker's last destroy, as after one initialize."""
    import torch.distributed as dist

    assert not dist.is_initialized(), "an earlier test left a process group"
    worker = RLWorker(build_trainer_spec(_config(tmp_path, tiny_path)))
    worker.initialize(total_steps=2)
    first = worker.actor
    worker.initialize(total_steps=2)
    assert worker.actor is not first and first.model is None  # the old engine was freed
    assert dist.is_initialized()
    worker.destroy()
    assert not dist.is_initialized()
