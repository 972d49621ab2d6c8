"""Whether a run can learn: warnings, while it runs, about batches that teach nothing.

Policy-gradient RL learns from differences between rewards. Each step's batch is checked for
four ways to lose them:

- flat groups: every prompt's samples got one reward (the batch has several): with
  group-relative advantages (GRPO's) every advantage is 0, and so is the gradient;
- a constant batch: every sample of the batch got the same reward: all 0, say, and the reward
  function, the prompt template or the answer format is likely wrong; all the best reward,
  and the items are already solved; if earlier batches of the run had other rewards, the
  rewards are rare instead, and the warning says so, or, where an earlier batch did well
  (its mean a third of the way up the rewards seen, or more), the policy got worse (a
  collapse);
- truncation: (nearly) every answer was cut at gconfig.max_new_tokens; where an earlier
  step's answers mostly fit, the warning says the answers grew instead;
- reward failures: the reward function raised (or timed out) for most episodes. Those
  episodes are not trained on (never scored 0); each is in <run>/failures.jsonl.

A condition warns once, when it has held for `health.steps` consecutive steps (reward
failures: at its first step), naming the likely cause and what to change; `findings` keeps
each with the steps it held, for the run's summary.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncrl.api import Trajectory

logger = logging.getLogger(__name__)

# "Nearly all answers cut": at least this fraction of a batch's trajectories.
TRUNCATED_FRAC = 0.9
# "Most episodes": more than this fraction of the episode runs since the last step.
FAILED_FRAC = 0.5
# "An earlier batch did well": its mean reward at least this far up the run's reward range.
COLLAPSE_FRAC = 1 / 3
# "Earlier answers fit": at most this fraction of a step's answers cut.
FIT_FRAC = 0.5
# Characters of a prompt (its end) or a completion quoted in a warning.
QUOTE_CHARS = 300
REWARD_ERRORS = ("RewardError", "RewardTimeout")


@dataclass
class StepSignals:
    """What the checks read of one step's batch."""

    step: int
    group_rewards: list[list[float]]  # each group's rewards, one per trajectory
    truncated_frac: float  # trajectories stopped by max_new_tokens, of all
    episodes: int  # episodes trained this step
    reward_failures: int = 0  # episode runs whose reward function raised since the last step
    failure: str = ""  # one of those failures' message
    sample: dict[str, Any] = field(default_factory=dict)  # one prompt, completion and reward


@dataclass
class Finding:
    """A condition that held for steps `first_step` to `last_step`; `message` says why it
    matters and what to change."""

    condition: str
    first_step: int
    last_step: int
    message: str

    def __str__(self) -> str:
        return f"steps {self.first_step}-{self.last_step}: {self.message}"


class HealthMonitor:
    """Checks each step's signals; warns once per condition that held for `steps` steps.

    `group_baseline`: advantages are centred per group (actor.reward_norm.mean_level=group),
    so flat groups give no gradient; otherwise that check is off.
    """

    def __init__(self, steps: int, *, max_new_tokens: int, group_baseline: bool = True) -> None:
        self.max_new_tokens = max_new_tokens
        self.checks: dict[str, tuple[int, Callable[[StepSignals], str | None]]] = {
            "constant_reward": (steps, self._constant),
            "truncated": (steps, self._truncated),
            "reward_failures": (1, self._reward_failures),
        }
        if group_baseline:
            self.checks["flat_groups"] = (steps, self._flat_groups)
        self._streaks: dict[str, tuple[int, int]] = {}  # condition: (first step, steps held)
        self._found: dict[str, Finding] = {}
        self._seen: tuple[float, float] | None = None  # the run's lowest and highest reward
        self._best: tuple[float, int] | None = None  # the highest batch mean reward, its step
        self._fit: tuple[float, int] | None = None  # the lowest truncated fraction, its step

    @property
    def findings(self) -> list[Finding]:
        """Every condition that warned, in the order they warned."""
        return list(self._found.values())

    def observe(self, signals: StepSignals) -> list[Finding]:
        """Check one step; the conditions that warn at it (each logged as a warning)."""
        new = []
        for condition, (needed, check) in self.checks.items():
            message = check(signals)
            if message is None:
                self._streaks.pop(condition, None)
                continue
            first, held = self._streaks.get(condition, (signals.step, 0))
            self._streaks[condition] = (first, held + 1)
            found = self._found.get(condition)
            if found is not None:
                if found.first_step == first:  # the streak that warned goes on
                    found.last_step = signals.step
            elif held + 1 >= needed:
                found = self._found[condition] = Finding(condition, first, signals.step, message)
                logger.warning("the run cannot learn, %s", str(found))  # the range now
                new.append(found)
        rewards = [r for group in signals.group_rewards for r in group]
        if rewards:
            low, high = min(rewards), max(rewards)
            self._seen = (low, high) if self._seen is None else (
                min(low, self._seen[0]), max(high, self._seen[1]))
            mean = sum(rewards) / len(rewards)
            if self._best is None or mean > self._best[0]:
                self._best = (mean, signals.step)
        if self._fit is None or signals.truncated_frac < self._fit[0]:
            self._fit = (signals.truncated_frac, signals.step)
        return new

    def _constant(self, s: StepSignals) -> str | None:
        rewards = {r for group in s.group_rewards for r in group}
        if len(rewards) != 1 or sum(map(len, s.group_rewards)) < 2:
            return None
        reward = next(iter(rewards))
        if self._seen is not None and self._seen != (reward, reward):
            (low, high), (best, step) = self._seen, self._best
            if best - reward >= COLLAPSE_FRAC * (high - low):
                return (f"every sample got reward {reward:g}, while the batch of step {step} "
                        f"had a mean reward of {best:.3g}: the policy got worse, as it does "
                        "when its updates are too large (a collapse). Lower "
                        "actor.optimizer.lr, add a KL term to the starting model "
                        "(actor.kl_ctl), and restart from a checkpoint before the drop.")
            return (f"every sample got reward {reward:g}, while earlier batches of this run "
                    f"had rewards from {self._seen[0]:g} to {self._seen[1]:g}: the rewards "
                    "are too rare for a batch to hold a difference, and the gradient is 0. "
                    "Raise gconfig.n_samples, turn on rollout.dynamic_sampling (it trains only "
                    "on groups with a difference), or start from a stronger model (SFT first).")
        sample = s.sample
        shown = (f" One sample: prompt ...{sample['prompt'][-QUOTE_CHARS:]!r}, completion "
                 f"{sample['completion'][:QUOTE_CHARS]!r}, reward {sample['reward']:g}."
                 if sample else "")
        return (f"every sample got reward {reward:g}, so no answer is preferred to "
                f"another. If {reward:g} is the reward's best value, the model already solves "
                "these items: train on harder ones (or from a weaker start). Otherwise the "
                "reward function, the prompt template (workflow.system_prompt, few_shot) or "
                "the answer format it expects is likely wrong." + shown)

    @staticmethod
    def _flat_groups(s: StepSignals) -> str | None:
        flat = all(len(set(group)) == 1 for group in s.group_rewards)
        constant = len({r for group in s.group_rewards for r in group}) == 1
        if not flat or constant:  # a constant batch has its own, more specific warning
            return None
        return ("every prompt's samples got one reward (rewards differ only between "
                "prompts): each group-relative advantage is 0, and so is the gradient. Turn "
                "on rollout.dynamic_sampling (it drops such groups), raise gconfig.n_samples "
                "or gconfig.temperature, or give partial credit in the reward.")

    def _truncated(self, s: StepSignals) -> str | None:
        if s.truncated_frac < TRUNCATED_FRAC:
            return None
        if self._fit is not None and self._fit[0] <= FIT_FRAC:
            fit, step = self._fit
            return (f"{s.truncated_frac:.0%} of the answers were cut at gconfig.max_new_tokens="
                    f"{self.max_new_tokens}, while at step {step} {fit:.0%} were: the answers "
                    "grew during the run, as they do when the policy drifts or collapses. "
                    "Check the samples; lower actor.optimizer.lr, or penalise length "
                    "(actor.overlong_reward_penalty).")
        return (f"{s.truncated_frac:.0%} of the answers were cut at gconfig.max_new_tokens="
                f"{self.max_new_tokens}, before their final answer. Raise "
                "gconfig.max_new_tokens (or ask for shorter answers in the prompt).")

    @staticmethod
    def _reward_failures(s: StepSignals) -> str | None:
        runs = s.reward_failures + s.episodes
        if s.reward_failures == 0 or s.reward_failures <= FAILED_FRAC * runs:
            return None
        return (f"the reward function raised for {s.reward_failures} of {runs} episode runs; "
                "they are not trained on (<run>/failures.jsonl has each). Fix the reward "
                f"function or the items it reads. One failure: {s.failure[:QUOTE_CHARS]}")


def step_signals(step: int, trajectories: list[Trajectory], failures: list[dict[str, Any]],
                 decode: Callable[[list[int]], str]) -> StepSignals:
    """The signals of a step from its batch's trajectories and the failed episode runs
    since the last step (RolloutController.take_failures' reports); `decode` turns the
    first trajectory's prompt into text for a warning."""
    groups: dict[str, list[float]] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(t.meta.get("raw_reward", t.reward))
    reward_failures = [f for f in failures if f["error"].startswith(REWARD_ERRORS)]
    first = trajectories[0]
    n_prompt = first.loss_mask.index(1) if 1 in first.loss_mask else len(first.input_ids)
    completion = first.meta.get("completion")
    if completion is None:
        completion = decode(first.input_ids[n_prompt:])
    return StepSignals(
        step=step, group_rewards=list(groups.values()),
        truncated_frac=sum(t.stop_reason.value == "length" for t in trajectories)
        / len(trajectories),
        episodes=len(groups), reward_failures=len(reward_failures),
        failure=reward_failures[0]["error"] if reward_failures else "",
        sample={"prompt": decode(first.input_ids[:n_prompt]), "completion": completion,
                "reward": first.meta.get("raw_reward", first.reward)})
