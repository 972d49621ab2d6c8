"""Cores shared on demand (api/cores.py): the division rule, the shared file, and the two
parties that follow it, the train engine (per decoder layer) and the local engine (per step)."""

import threading
import time

import pytest
import torch

from asyncrl.api import cores
from asyncrl.api.cores import SLOTS, TRAINER_SLOT, CoreShare, threads_for
from asyncrl.config.engine import TrainEngineSpec
from asyncrl.inference.server.engine import LocalEngine
from asyncrl.models.tiny import make_tiny_model
from asyncrl.trainer import FSDPTrainEngine


def _homes(**slots):
    homes = [0] * SLOTS
    for slot, home in slots.items():
        homes[int(slot[1:])] = home
    return homes


@pytest.mark.parametrize("busy_slots, expected", [
    # trainer (s0, home 1) and one server (s1, home 1), on 2 cores
    ({0, 1}, {0: 1, 1: 1}),  # both busy: each its own core
    ({0}, {0: 2, 1: 1}),  # server idle: the trainer takes both; idle keeps its home count
    ({1}, {0: 1, 1: 2}),
    (set(), {0: 1, 1: 1}),
])
def test_two_parties_lend_each_other_their_core(busy_slots, expected):
    homes = _homes(s0=1, s1=1)
    busy = [s in busy_slots for s in range(SLOTS)]
    assert {s: threads_for(s, homes, busy) for s in (0, 1)} == expected


def test_idle_cores_are_divided_among_the_busy_in_slot_order():
    # 3 idle cores (s2: 2, s3: 1) over 2 busy parties: s0 gets 2 of them, s1 one.
    homes = _homes(s0=2, s1=1, s2=2, s3=1)
    busy = [s in (0, 1) for s in range(SLOTS)]
    assert [threads_for(s, homes, busy) for s in range(4)] == [4, 2, 2, 1]
    # absent slots (home 0) lend nothing even when "idle"
    assert threads_for(0, _homes(s0=1), [s == 0 for s in range(SLOTS)]) == 1


def test_parties_see_each_others_state_through_the_file(tmp_path):
    path = CoreShare.create(str(tmp_path / "share"))
    trainer, server = CoreShare(path, TRAINER_SLOT, 1), CoreShare(path, 0, 1)
    server.set_busy(True)
    with trainer.busy():
        assert trainer.threads() == 1  # the server generates: one core each
        server.set_busy(False)
        assert trainer.threads() == 2
        with trainer.busy():  # nested: still busy after the inner block
            pass
        assert server.threads() == 1 and trainer.homes_and_busy()[1][TRAINER_SLOT]
    assert not trainer.homes_and_busy()[1][TRAINER_SLOT]
    server.close()  # a party that leaves lends nothing
    trainer.set_busy(True)
    assert trainer.threads() == 1
    trainer.close()


def test_from_env_names_a_malformed_value(monkeypatch, tmp_path):
    monkeypatch.setenv(cores.ENV, str(tmp_path / "share"))
    with pytest.raises(ValueError, match="ASYNCRL_CORE_SHARE must be '<path>,<slot>'"):
        CoreShare.from_env(home=1)
    monkeypatch.delenv(cores.ENV)
    assert CoreShare.from_env(home=1) is None


@pytest.fixture
def share(tmp_path):
    path = CoreShare.create(str(tmp_path / "share"))
    server = CoreShare(path, 0, 1)
    mine = CoreShare(path, TRAINER_SLOT, 1)
    previous = cores.join(mine)
    threads = torch.get_num_threads()
    yield server
    cores.join(previous)
    torch.set_num_threads(threads)
    mine.close()
    server.close()


@pytest.mark.usefixtures("process_group")
def test_train_engine_takes_an_idle_servers_core_per_layer(tmp_path, share):
    from batches import random_batch

    engine = FSDPTrainEngine(TrainEngineSpec(path=make_tiny_model(str(tmp_path / "tiny")),
                                             dtype="float32"), total_steps=2)
    engine.initialize()
    seen, seen_backward = [], []  # threads in force in each layer's forward / backward

    def record(module, args, output):
        seen.append(torch.get_num_threads())
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.requires_grad:  # runs after the engine's own hook on that gradient
            hidden.register_hook(lambda grad: seen_backward.append(torch.get_num_threads()))

    layers = engine.model.hf.get_decoder().layers
    for layer in layers:
        layer.register_forward_hook(record)
    batch = random_batch()

    def loss_fn(logprobs, mb, *, n_tokens, n_seqs):
        return -(logprobs * mb.loss_mask).sum() / n_tokens, {}

    share.set_busy(True)  # the server generates the whole step: one core
    engine.train_batch(batch, loss_fn)
    assert set(seen) == {1}
    seen.clear()
    share.set_busy(False)  # the server idles: both cores, from the first layer on
    engine.compute_logprobs(batch)
    assert set(seen) == {2}
    seen.clear()

    # The server wakes up after the last layer's forward: the backward uses one core.
    n = len(layers)
    wake = layers[-1].register_forward_hook(lambda *_: share.set_busy(True))
    share.set_busy(False)
    seen_backward.clear()
    engine.train_batch(batch, loss_fn)
    assert (seen, seen_backward) == ([2] * n, [1] * n)
    wake.remove()
    seen.clear()
    seen_backward.clear()
    # ... and after the first layer's forward: the layers after that point use one core.
    layers[0].register_forward_hook(lambda *_: share.set_busy(True))
    share.set_busy(False)
    engine.train_batch(batch, loss_fn)
    assert (seen, seen_backward) == ([2] + [1] * (n - 1), [1] * n)
    engine.destroy()


def test_local_engine_is_busy_and_borrows_only_while_it_has_sequences(tmp_path):
    from asyncrl.api.types import GenerationRequest, SamplingParams

    path = CoreShare.create(str(tmp_path / "share"))
    mine = CoreShare(path, 0, 1)
    trainer = CoreShare(path, TRAINER_SLOT, 1)
    engine = LocalEngine.spawn(make_tiny_model(str(tmp_path / "tiny")), share=mine, threads=1)
    steps = []  # (busy flag, threads) seen inside each step, in the engine's thread
    step = engine.step
    engine.step = lambda: (steps.append((mine.homes_and_busy()[1][0], torch.get_num_threads())),
                           step())
    done = threading.Event()

    def generate(greedy_tokens: int) -> None:
        done.clear()
        engine.submit(GenerationRequest(input_ids=[1, 2, 3], sampling=SamplingParams(
            max_new_tokens=greedy_tokens, temperature=0.0, ignore_eos=True)),
                      lambda r: done.set())
        assert done.wait(30)

    generate(4)  # the trainer idles: the engine borrows its core
    assert steps and all(s == (True, 2) for s in steps)
    deadline = time.monotonic() + 5
    while mine.homes_and_busy()[1][0] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not mine.homes_and_busy()[1][0]  # idle once it has nothing to do
    steps.clear()
    trainer.set_busy(True)  # the trainer trains: one core each
    generate(4)
    assert steps and all(s == (True, 1) for s in steps)
    engine.close()
    trainer.close()
    mine.close()


def test_compute_copies_cast_gives_a_waking_server_its_core_at_the_next_tensor(
        monkeypatch, share):
    # The first cast of a step runs as the server wakes up (it starts generating for the
    # version just published); two threads per cast on two cores beside the server's made
    # the cast ~1 s instead of ~80 ms in the quickstart.
    from asyncrl.trainer.cpu import precision

    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(3)))  # 6 tensors
    copies = precision.ComputeWeights(model, torch.bfloat16)
    seen = []  # threads in force as each tensor is cast
    adjust = cores.adjust

    def adjust_and_wake_the_server_after_two():
        adjust()
        seen.append(torch.get_num_threads())
        if len(seen) == 2:
            share.set_busy(True)

    monkeypatch.setattr(cores, "adjust", adjust_and_wake_the_server_after_two)
    share.set_busy(False)
    with cores.busy(), copies.active():
        assert seen == [2, 2, 1, 1, 1, 1]
        assert model[2].bias.dtype == torch.bfloat16


def test_local_engine_is_busy_while_it_copies_new_weights(tmp_path):
    # The copy runs in the caller's thread (one core) while the loop may idle: a trainer
    # that had borrowed the server's core gives it back for the copy, and gets it again
    # once the swap is done, or at once when the load fails.
    from safetensors.torch import load_file

    from asyncrl.inference.server.model import CheckpointError

    path = CoreShare.create(str(tmp_path / "share"))
    mine = CoreShare(path, 0, 1)
    trainer = CoreShare(path, TRAINER_SLOT, 1)
    folder = make_tiny_model(str(tmp_path / "tiny"))
    engine = LocalEngine.spawn(folder, share=mine, threads=1)
    weights = load_file(f"{folder}/model.safetensors")
    seen = []

    def named(fail_after=None):
        for i, (name, tensor) in enumerate(weights.items()):
            seen.append(mine.homes_and_busy()[1][0])
            if i == fail_after:
                raise OSError("the file went away")
            yield name, tensor

    def idle_within(seconds):
        deadline = time.monotonic() + seconds
        while mine.homes_and_busy()[1][0] and time.monotonic() < deadline:
            time.sleep(0.01)
        return not mine.homes_and_busy()[1][0]

    trainer.set_busy(True)
    assert idle_within(5) and trainer.threads() == 2  # the server idles: both cores
    engine.load_weights(named(), version=1)
    assert seen and all(seen) and engine.version == 1
    assert idle_within(5) and trainer.threads() == 2
    seen.clear()
    with pytest.raises(OSError, match="went away"):
        engine.load_weights(named(fail_after=2), version=2)
    assert seen == [True] * 3 and engine.version == 1
    assert idle_within(5) and trainer.threads() == 2
    with pytest.raises(CheckpointError):
        engine.load_weights(iter([]), version=3)  # nothing came: missing tensors
    assert idle_within(5)
    engine.close()
    trainer.close()
    mine.close()
