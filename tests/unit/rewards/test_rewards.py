"""Rewards: GSM8K answer checking, reasoning-gym scoring, and the reward runner's failures."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from asyncrl.data import load_jsonl
from asyncrl.rewards import (
    RewardError,
    RewardRunner,
    RewardTimeout,
    extract_final_answer,
    gsm8k_reward,
    resolve_reward_fn,
)


@pytest.fixture(scope="module")
def gsm8k_test_items(gsm8k_dir) -> list[dict]:
    return load_jsonl(gsm8k_dir / "test.jsonl", limit=200)


# Module level, so that a worker process can import it by reference.
def misbehaving_reward(completion: str, item: dict) -> float:
    if completion == "raise":
        raise ValueError("scorer exploded")
    if completion == "sleep":
        time.sleep(60)
    if completion == "nan":
        return math.nan
    return 1.0


def run(coro):
    return asyncio.run(coro)


# -- GSM8K answer extraction and checking ------------------------------------------------


def test_gold_solution_scores_one_against_its_own_answer(gsm8k_test_items):
    scores = [gsm8k_reward(item["solution"], item) for item in gsm8k_test_items[:50]]
    assert scores == [1.0] * 50


def test_perturbed_final_number_scores_zero(gsm8k_test_items):
    item = gsm8k_test_items[0]  # Janet's ducks: "#### 18"
    assert item["answer"] == "18"
    perturbed = item["solution"].replace("#### 18", "#### 19")
    assert gsm8k_reward(perturbed, item) == 0.0


def test_boxed_answer_is_read_including_nested_braces(gsm8k_test_items):
    item = gsm8k_test_items[0]
    assert gsm8k_reward("She makes 9 * 2 = 18 dollars, so \\boxed{18}.", item) == 1.0
    assert gsm8k_reward("\\boxed{\\frac{36}{2}}", item) == 1.0
    assert gsm8k_reward("\\boxed{17}", item) == 0.0


def test_thousands_commas_are_not_tuples(gsm8k_test_items):
    item = next(i for i in gsm8k_test_items if "," in i["solution"].rsplit("####", 1)[1])
    assert "," not in item["answer"]  # the loader removed it from the ground truth
    assert gsm8k_reward(item["solution"], item) == 1.0
    assert gsm8k_reward("#### 1,000", {"answer": "1000"}) == 1.0
    assert gsm8k_reward("\\boxed{70,000}", {"answer": "70000"}) == 1.0
    assert gsm8k_reward("#### $70,000.", {"answer": "70000"}) == 1.0


def test_a_number_without_the_answer_format_scores_zero():
    # No last-number fallback: the format is "#### N" or \boxed{N}.
    assert extract_final_answer("The answer is 18") is None
    assert gsm8k_reward("The answer is 18", {"answer": "18"}) == 0.0


def test_the_later_of_hashes_and_boxed_is_the_answer():
    assert extract_final_answer("#### 5\nno wait, \\boxed{7}") == "7"
    assert extract_final_answer("\\boxed{7} hmm\n#### 5 apples") == "5"


# -- reasoning-gym ------------------------------------------------------------------------

RG_OPTIONS = dict(min_terms=2, max_terms=2, min_digits=2, max_digits=2, operators=("+",),
                  allow_parentheses=False, allow_negation=False)


def test_reasoning_gym_gold_answer_scores_one_and_a_wrong_one_zero():
    from asyncrl.data import load_reasoning_gym
    from asyncrl.rewards.rgym import reasoning_gym_reward

    items = load_reasoning_gym("basic_arithmetic", size=5, seed=3, **RG_OPTIONS)
    for item in items:
        wrong = str(int(item["answer"]) + 1)
        assert reasoning_gym_reward(f"<answer>{item['answer']}</answer>", item) == 1.0
        assert reasoning_gym_reward(f"<answer>{wrong}</answer>", item) == 0.0
        assert reasoning_gym_reward(item["answer"], item) == 0.0  # no tags: no answer


# -- resolving names ----------------------------------------------------------------------


def test_reward_names_resolve_to_functions():
    assert resolve_reward_fn("gsm8k") is gsm8k_reward
    assert resolve_reward_fn("asyncrl.rewards.gsm8k:gsm8k_reward") is gsm8k_reward
    assert resolve_reward_fn("reasoning_gym").__name__ == "reasoning_gym_reward"


@pytest.mark.parametrize("name, complaint", [
    ("gsm9k", "unknown reward_fn 'gsm9k'"),
    ("no_such_pkg.mod:fn", "cannot import module 'no_such_pkg.mod'"),
    ("asyncrl.rewards.gsm8k:nope", "has no attribute 'nope'"),
])
def test_bad_reward_names_are_rejected_by_name(name, complaint):
    with pytest.raises(ValueError, match=complaint):
        resolve_reward_fn(name)


# -- the runner ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def misbehaving_runner():
    runner = RewardRunner(misbehaving_reward, timeout=1.0, workers=1)
    yield runner
    runner.close()


def test_a_raising_reward_raises_reward_error_naming_fn_item_and_cause(misbehaving_runner):
    with pytest.raises(RewardError) as info:
        run(misbehaving_runner.score("raise", {"id": "item-7"}))
    err = info.value
    assert not isinstance(err, RewardTimeout)
    assert "misbehaving_reward" in str(err) and "'item-7'" in str(err)
    assert "scorer exploded" in str(err) and "'raise'" in str(err)
    assert isinstance(err.__cause__, ValueError) and err.item_id == "item-7"


def test_a_nan_reward_is_an_error_not_a_score(misbehaving_runner):
    with pytest.raises(RewardError, match="expected a finite number"):
        run(misbehaving_runner.score("nan", {"id": "item-8"}))


def test_a_hung_reward_times_out_and_the_runner_recovers(misbehaving_runner):
    start = time.perf_counter()
    with pytest.raises(RewardTimeout, match="'item-9'"):
        run(misbehaving_runner.score("sleep", {"id": "item-9"}))
    assert time.perf_counter() - start < 1.0 + 1.5
    assert run(misbehaving_runner.score("fine", {"id": "item-10"})) == 1.0  # a fresh worker


def test_closing_the_runner_during_a_call_fails_that_call_and_nothing_else():
    # The run's end closes the runner while rollouts may still be scoring: the call in
    # flight fails as a RewardError, and close() itself does not raise (the worker is
    # stopped by close() and by the failed call's thread, once).
    runner = RewardRunner(misbehaving_reward, timeout=30.0, workers=1)
    loop = asyncio.new_event_loop()
    try:
        call = loop.create_task(runner.score("sleep", {"id": "item-11"}))
        loop.run_until_complete(asyncio.sleep(0.5))
        deadline = time.monotonic() + 20  # the worker process is spawned by the call
        while not runner._live and time.monotonic() < deadline:
            time.sleep(0.05)
        [worker] = runner._live
        start = time.perf_counter()
        runner.close()
        with pytest.raises(RewardError):
            loop.run_until_complete(call)
        assert time.perf_counter() - start < 10.0
        assert worker.conn.closed and not worker.proc.is_alive()
        worker.kill()  # again: a no-op
    finally:
        loop.close()


def test_math_verify_hang_is_stopped_by_the_timeout_in_a_worker_process():
    # sympy evaluates the power tower for ever; only killing the process stops it.
    runner = RewardRunner(gsm8k_reward, timeout=1.5, workers=1)
    try:
        assert run(runner.score("#### 18", {"id": "ok", "answer": "18"})) == 1.0
        with pytest.raises(RewardTimeout):
            run(runner.score("\\boxed{9^{9^{9^{9}}}}", {"id": "tower", "answer": "18"}))
    finally:
        runner.close()


def test_thread_runner_times_out_and_reports_errors():
    runner = RewardRunner(misbehaving_reward, timeout=0.3, processes=False)
    start = time.perf_counter()
    with pytest.raises(RewardTimeout):
        run(runner.score("sleep", {"id": "t1"}))
    assert time.perf_counter() - start < 0.3 + 0.5
    with pytest.raises(RewardError, match="scorer exploded"):
        run(runner.score("raise", {"id": "t2"}))
    # math-verify's signal-based timeouts are off, so it runs outside the main thread.
    threaded_gsm8k = RewardRunner(gsm8k_reward, timeout=5.0, processes=False)
    assert run(threaded_gsm8k.score("#### 1,000", {"id": "t3", "answer": "1000"})) == 1.0


def test_a_lambda_cannot_go_to_a_worker_process():
    with pytest.raises(TypeError, match="processes=False"):
        RewardRunner(lambda c, i: 1.0, timeout=1.0)
