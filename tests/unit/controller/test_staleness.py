"""The staleness rule of docs/architecture.md, case by case (numbers by hand)."""

import pytest

from asyncrl.controller.rollout import StalenessManager


@pytest.mark.parametrize(
    "B, eta, version, accepted, running, max_concurrent, expected",
    [
        (4, 0, 0, 0, 0, 100, 4),  # (0+0+1)*4 - 0
        (4, 0, 0, 2, 2, 100, 0),  # the first batch is fully in flight
        (4, 0, 1, 4, 0, 100, 4),  # synchronous: the next batch only after version 1
        (4, 2, 1, 5, 3, 100, 8),  # (2+1+1)*4 - (5+3) = 8
        (4, 2, 1, 5, 3, 6, 3),  # concurrency caps it: 6 - 3
        (8, 4, 3, 40, 20, 32, 4),  # (4+3+1)*8 - 60 = 4; concurrency allows 12
        (4, 1, 0, 9, 0, 100, 0),  # over the bound: zero, never negative
    ],
)
def test_capacity_cases(B, eta, version, accepted, running, max_concurrent, expected):
    m = StalenessManager(B, eta, max_concurrent, accepted=accepted, running=running)
    assert m.capacity(version) == expected


def test_rejected_episodes_free_their_place():
    m = StalenessManager(2, 0, 10)
    for _ in range(2):
        m.on_submit()
    assert m.capacity(0) == 0
    m.on_reject()
    assert (m.capacity(0), m.rejected) == (1, 1)
    m.on_accept()
    assert (m.capacity(0), m.accepted, m.running) == (1, 1, 0)


def test_finishing_an_unsubmitted_episode_is_an_error():
    with pytest.raises(RuntimeError, match="never submitted"):
        StalenessManager(2, 0, 10).on_accept()


def test_resume_restores_counters_and_requeues_running():
    m = StalenessManager(4, 1, 100, accepted=7, running=3, rejected=2)
    restored = StalenessManager(4, 1, 100)
    restored.load_state_dict(m.state_dict())
    assert (restored.accepted, restored.running, restored.rejected) == (7, 0, 2)
    # (1+1+1)*4 - 7 = 5: the 3 in-flight items are re-submitted within this capacity
    assert restored.capacity(1) == 5


@pytest.mark.parametrize(
    "eta, ahead, version, accepted, expected",
    [
        (4, None, 2, 8, 20),  # (4+2+1)*4 - 8: the bound itself
        (4, 1, 2, 8, 8),  # (1+2+1)*4 - 8: one version ahead only
        (4, 3, 2, 8, 16),  # (3+2+1)*4 - 8
        (2, 5, 2, 8, 12),  # ahead past eta: eta, (2+2+1)*4 - 8
        (4, 1, 2, 16, 0),  # two batches ahead already: none
    ],
)
def test_demand_admission_applies_ahead_within_eta(eta, ahead, version, accepted, expected):
    m = StalenessManager(4, eta, 100, accepted=accepted, ahead=ahead)
    assert m.capacity(version) == expected


def test_resume_restores_ahead_of_the_demand_rule_only():
    m = StalenessManager(4, 3, 100, accepted=7, ahead=3)
    demand, bound = StalenessManager(4, 3, 100, ahead=1), StalenessManager(4, 3, 100)
    demand.load_state_dict(m.state_dict())
    bound.load_state_dict(m.state_dict())
    assert (demand.ahead, bound.ahead) == (3, None)
    smaller = StalenessManager(4, 2, 100, ahead=1)  # resumed with a smaller eta: capped
    smaller.load_state_dict(m.state_dict())
    assert smaller.ahead == 2
    older = StalenessManager(4, 3, 100, ahead=1)  # a checkpoint from before the rule
    older.load_state_dict({"accepted": 7, "rejected": 0})
    assert older.ahead == 1
