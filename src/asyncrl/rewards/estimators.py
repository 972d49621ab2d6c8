"""Scores of an item from its n sampled answers: pass@k, maj@k, mean@k.

pass@k is the unbiased estimator of Chen et al. 2021 (the Codex paper): with c correct among
n samples, the chance that k drawn without replacement hold at least one correct one,
1 - C(n-c, k) / C(n, k). It is computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i), which never
forms the binomials (they overflow floats for n in the hundreds).

maj@k votes over the first k samples' extracted answers (samples with no answer do not
vote; a tie goes to the answer that came first) and scores the vote with the reward of the
first sample that gave it; an item where no sample gave an answer scores 0. mean@k is the
mean reward of the first k samples. Both use the first k samples, so they are exact for
k = n and a single draw (not an average over subsets) for k < n.
"""

from __future__ import annotations

from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of an item with `c` correct samples out of `n`."""
    if not 0 <= c <= n:
        raise ValueError(f"pass@k: correct samples c={c} must be in [0, n={n}]")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k: k={k} must be in [1, n={n}] (draw at least k samples per "
                         "item)")
    if n - c < k:
        return 1.0  # every k-subset holds a correct sample
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def maj_at_k(answers: Sequence[str | None], rewards: Sequence[float], k: int) -> float:
    """maj@k: the reward of the majority answer among the first `k` samples."""
    if len(answers) != len(rewards):
        raise ValueError(f"maj@k: {len(answers)} answers but {len(rewards)} rewards")
    if not 1 <= k <= len(answers):
        raise ValueError(f"maj@k: k={k} must be in [1, n={len(answers)}]")
    votes: dict[str, int] = {}
    first_reward: dict[str, float] = {}
    for answer, reward in zip(answers[:k], rewards[:k]):
        if answer is None:
            continue
        votes[answer] = votes.get(answer, 0) + 1
        first_reward.setdefault(answer, reward)
    if not votes:
        return 0.0
    top = max(votes.values())
    winner = next(a for a in votes if votes[a] == top)  # dicts keep first-seen order
    return first_reward[winner]


def mean_at_k(rewards: Sequence[float], k: int) -> float:
    """mean@k: the mean reward of the first `k` samples."""
    if not 1 <= k <= len(rewards):
        raise ValueError(f"mean@k: k={k} must be in [1, n={len(rewards)}]")
    return sum(rewards[:k]) / k
