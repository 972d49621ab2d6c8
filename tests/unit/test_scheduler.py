"""Core split between servers and trainer; when periodic work is due."""

import pytest

from asyncrl.config.schema import SaverConfig
from asyncrl.scheduler import SchedulerError, split_cores
from asyncrl.trainers.periodic import Periodic


@pytest.mark.parametrize("cores, inference, trainer, n_servers, expected", [
    ([0, 1], None, None, 1, ([[1]], [0])),  # the 2-core machine: one core each
    (list(range(8)), None, None, 2, ([[4, 5], [6, 7]], [0, 1, 2, 3])),
    (list(range(8)), 2, None, 1, ([[6, 7]], [0, 1, 2, 3, 4, 5])),
    (list(range(8)), None, 6, 1, ([[6, 7]], [0, 1, 2, 3, 4, 5])),
    ([0], None, None, 1, ([[0]], [0])),  # one core: shared, with a warning
])
def test_cores_are_split_between_servers_and_trainer(cores, inference, trainer, n_servers,
                                                      expected):
    assert split_cores(cores, inference, trainer, n_servers) == expected


def test_fewer_inference_cores_than_servers_is_an_error():
    with pytest.raises(SchedulerError, match="inference_threads=1 is fewer than rollout.n_servers=2"):
        split_cores([0, 1, 2, 3], 1, None, 2)


def test_periodic_is_due_by_steps_epochs_or_seconds():
    every_3 = Periodic(SaverConfig(freq_steps=3), steps_per_epoch=10)
    assert [s for s in range(1, 10) if every_3.due(s, now=0.0)] == [3, 6, 9]
    per_epoch = Periodic(SaverConfig(freq_epochs=1), steps_per_epoch=4)
    assert [s for s in range(1, 10) if per_epoch.due(s, now=0.0)] == [4, 8]
    timed = Periodic(SaverConfig(freq_secs=60.0), steps_per_epoch=4, now=0.0)
    assert [timed.due(1, 30.0), timed.due(2, 61.0), timed.due(3, 100.0), timed.due(4, 122.0)] \
        == [False, True, False, True]
    assert not Periodic(SaverConfig(), steps_per_epoch=4).enabled


def test_the_trainer_gets_its_cores_back_after_a_run(tmp_path):
    import os

    import torch

    from asyncrl.config.schema import SchedulerConfig
    from asyncrl.scheduler import LocalScheduler

    before = (os.sched_getaffinity(0), torch.get_num_threads())
    with LocalScheduler(SchedulerConfig(), tmp_path) as scheduler:
        scheduler.trainer_cores = sorted(before[0])[:1]
        assert scheduler.pin_trainer() == 1
        assert os.sched_getaffinity(0) == set(scheduler.trainer_cores)
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == before
