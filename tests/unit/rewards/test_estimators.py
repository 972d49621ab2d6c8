"""pass@k, maj@k and mean@k against enumeration and answers worked out by hand."""

import itertools
import math
from fractions import Fraction

import pytest

from asyncrl.rewards.estimators import maj_at_k, mean_at_k, pass_at_k


def brute_force_pass_at_k(correct: list[bool], k: int) -> Fraction:
    """The share of all k-subsets of the samples that hold a correct one."""
    subsets = list(itertools.combinations(correct, k))
    return Fraction(sum(any(s) for s in subsets), len(subsets))


@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_equals_the_share_of_k_subsets_with_a_correct_sample(n):
    for c in range(n + 1):
        correct = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(float(brute_force_pass_at_k(correct, k)),
                                                       abs=1e-12), (n, c, k)


def test_pass_at_k_stays_exact_where_the_binomials_overflow_floats():
    n, c, k = 2000, 3, 500  # C(2000, 500) ~ 1e486: math.comb in floats would overflow
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)
    assert pass_at_k(10, 0, 3) == 0.0 and pass_at_k(10, 8, 3) == 1.0


def test_pass_at_1_is_the_share_correct():
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)


@pytest.mark.parametrize("n, c, k", [(4, 1, 5), (4, 5, 1), (4, 1, 0)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k"):
        pass_at_k(n, c, k)


def test_maj_at_k_scores_the_most_common_answer_among_the_first_k():
    answers = ["4", "5", "4", None, "5", "5"]
    rewards = [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert maj_at_k(answers, rewards, 1) == 1.0  # "4"
    assert maj_at_k(answers, rewards, 2) == 1.0  # "4" and "5" tie: the first seen wins
    assert maj_at_k(answers, rewards, 3) == 1.0  # "4" twice
    assert maj_at_k(answers, rewards, 4) == 1.0  # None does not vote
    assert maj_at_k(answers, rewards, 5) == 1.0  # 2 - 2 tie, "4" first
    assert maj_at_k(answers, rewards, 6) == 0.0  # "5" three times


def test_maj_at_k_is_zero_when_no_sample_gave_an_answer():
    assert maj_at_k([None, None], [0.0, 0.0], 2) == 0.0


def test_mean_at_k_averages_the_first_k_rewards():
    rewards = [1.0, 0.0, 0.5, 0.5]
    assert (mean_at_k(rewards, 1), mean_at_k(rewards, 2), mean_at_k(rewards, 4)) == \
        (1.0, 0.5, 0.5)
    with pytest.raises(ValueError, match="mean@k: k=5"):
        mean_at_k(rewards, 5)
