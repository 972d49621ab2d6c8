"""Token-exact capture of an agent's conversation, and its export as trajectories.

Every completion a session makes is kept as the engine produced it: prompt ids, output
ids, their log-probs and weight versions. Nothing is re-tokenised for training.

Two export styles:
- `individual`: one trajectory per completion (prompt masked, output trained).
- `tree`: completions are merged along the conversation. A completion whose prompt ids
  start with an earlier completion's prompt + output ids is that completion's child (the
  latest such, when several qualify). Each leaf becomes one trajectory, its ids the leaf's
  prompt + output, its loss mask on every output span along the path from the root; the
  tokens in between (tool results, user turns, template glue) are masked out.
  A completion whose prompt extends an earlier completion's *prompt* but not its prompt
  + output is a turn whose history was re-rendered differently from what was sampled
  (a template that strips or rewrites earlier turns, or a text that re-tokenises
  differently). Merging it would train on tokens the model never produced, so it is
  exported on its own and counted as `drift`.

Rewards: a completion's own reward r_i is what `set_reward` gave it (0 when unset). They
are propagated backwards over the session's completions in the order they were made,
G_i = r_i + turn_discount * G_{i+1} (AReaL's semantics). A per-completion trajectory
gets G_i; a merged leaf trajectory gets G of the first completion on its path, i.e. what
the conversation earned from its first turn (with one final reward: discount^(turns-1) r).
A drifted turn's trajectory gets the same G as the conversation it continues: every piece
of one conversation carries what the conversation earned. (With its own G_i, a drifted
last turn earned the whole undiscounted reward, more than any conversation of its group,
and group-relative advantages taught the search agent to answer without a second search.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from asyncrl.api.types import ImageInputs, StopReason, Trajectory

ExportStyle = Literal["tree", "individual"]


@dataclass(kw_only=True)
class Completion:
    """One generation of a session, exactly as sampled."""

    id: str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    stop_reason: StopReason
    route: str = "chat"  # chat | completions | responses | messages
    request: dict[str, Any] = field(default_factory=dict)  # the body, for the record
    text: str = ""  # the decoded output
    reward: float | None = None
    created: float = field(default_factory=time.time)
    images: ImageInputs | None = None  # the images its prompt's image tokens stand for

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "route": self.route, "prompt_ids": self.prompt_ids,
                "output_ids": self.output_ids, "logprobs": self.logprobs,
                "versions": self.versions, "stop_reason": self.stop_reason.value,
                "text": self.text, "reward": self.reward, "created": self.created,
                "request": self.request,
                **({"images": self.images.to_dict()} if self.images is not None else {})}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Completion:
        """The inverse of `to_dict` (a completion sent between processes)."""
        images = d.get("images")
        return cls(**{**d, "stop_reason": StopReason(d["stop_reason"]),
                      "images": None if images is None else ImageInputs.from_dict(images)})


@dataclass
class Export:
    """The trajectories of one session, and how they were formed."""

    trajectories: list[Trajectory]
    merged: int = 0  # completions merged into a parent's trajectory
    drift: int = 0  # completions that continued a turn but did not extend it token for token


def returns(rewards: list[float | None], discount: float) -> list[float]:
    """G_i = r_i + discount * G_{i+1}, backwards over the completions (unset rewards are 0)."""
    out, g = [0.0] * len(rewards), 0.0
    for i in range(len(rewards) - 1, -1, -1):
        g = (rewards[i] or 0.0) + discount * g
        out[i] = g
    return out


def _starts_with(seq: list[int], prefix: list[int]) -> bool:
    return len(seq) >= len(prefix) and seq[: len(prefix)] == prefix


def _continues(c: Completion, prefix: list[int], earlier: Completion) -> bool:
    """Whether `c`'s prompt starts with `prefix` (ids of `earlier`) and its images with
    `earlier`'s: equal image tokens of other pixels are another conversation."""
    if not _starts_with(c.prompt_ids, prefix):
        return False
    if earlier.images is None:
        return True
    return c.images is not None and c.images.starts_with(earlier.images)


def parents(completions: list[Completion]) -> tuple[list[int | None], list[int | None]]:
    """Each completion's parent index (None: a root), and for a drifted turn the earliest
    completion whose conversation it continues (None: not drifted)."""
    parent: list[int | None] = []
    continues: list[int | None] = []
    for i, c in enumerate(completions):
        extends = [j for j in range(i) if _continues(c, completions[j].ids, completions[j])]
        parent.append(max(extends, key=lambda j: (len(completions[j].ids), j))
                      if extends else None)
        # A continuation of an earlier turn's prompt that does not contain what was sampled.
        earlier = [j for j in range(i) if len(c.prompt_ids) > len(completions[j].prompt_ids)
                   and _continues(c, completions[j].prompt_ids, completions[j])]
        continues.append(earlier[0] if earlier and not extends else None)
    return parent, continues


def export(completions: list[Completion], *, style: ExportStyle, discount: float,
           group_id: str, meta: dict[str, Any] | None = None) -> Export:
    """The trajectories of a session's completions (see the module docstring)."""
    if style not in ("tree", "individual"):
        raise ValueError(f"export style must be 'tree' or 'individual', got {style!r}")
    meta = dict(meta or {})
    g = returns([c.reward for c in completions], discount)
    if style == "individual" or not completions:
        return Export([_single(c, g[i], group_id, meta, turn=i) for i, c in enumerate(completions)])
    parent, continues = parents(completions)
    has_child = {p for p in parent if p is not None}
    out = Export([], merged=sum(p is not None for p in parent),
                 drift=sum(j is not None for j in continues))

    def root(i: int) -> int:
        while parent[i] is not None:
            i = parent[i]
        return i

    def start(i: int) -> int:
        """The first turn of the conversation a path's root belongs to."""
        while continues[i] is not None:
            i = root(continues[i])
        return i

    for i, c in enumerate(completions):
        if i in has_child:
            continue
        path = [i]
        while parent[path[-1]] is not None:
            path.append(parent[path[-1]])
        path.reverse()
        reward = g[start(path[0])]
        if len(path) == 1:
            out.trajectories.append(_single(c, reward, group_id, meta, turn=i,
                                            drift=continues[i] is not None))
        else:
            out.trajectories.append(_merged([completions[j] for j in path], reward,
                                            group_id, meta, turns=path))
    return out


def _single(c: Completion, reward: float, group_id: str, meta: dict[str, Any], *, turn: int,
            drift: bool = False) -> Trajectory:
    n = len(c.prompt_ids)
    return Trajectory(
        input_ids=c.ids, loss_mask=[0] * n + [1] * len(c.output_ids),
        behavior_logprobs=[0.0] * n + list(c.logprobs), versions=[-1] * n + list(c.versions),
        reward=reward, group_id=group_id, stop_reason=c.stop_reason, images=c.images,
        meta={**meta, "completion_ids": [c.id], "turns": [turn], "n_turns": 1,
              "truncated_turns": int(c.stop_reason == StopReason.LENGTH),
              "turn_spans": [[n, n + len(c.output_ids)]], "drift": drift})


def _merged(path: list[Completion], reward: float, group_id: str, meta: dict[str, Any], *,
            turns: list[int]) -> Trajectory:
    """The leaf's ids; loss on every output span along the path (each checked in place)."""
    leaf = path[-1]
    ids = leaf.ids
    mask, logprobs, versions = [0] * len(ids), [0.0] * len(ids), [-1] * len(ids)
    spans = []
    for c in path:
        start, end = len(c.prompt_ids), len(c.ids)
        if ids[start:end] != c.output_ids:  # parents() guarantees this; a bug if not
            raise AssertionError(f"completion {c.id} is not a prefix of leaf {leaf.id}")
        mask[start:end] = [1] * (end - start)
        logprobs[start:end] = c.logprobs
        versions[start:end] = c.versions
        spans.append([start, end])
    return Trajectory(input_ids=ids, loss_mask=mask, behavior_logprobs=logprobs,
                      versions=versions, reward=reward, group_id=group_id,
                      stop_reason=leaf.stop_reason, images=leaf.images,  # every turn's
                      meta={**meta, "completion_ids": [c.id for c in path], "turns": turns,
                            "n_turns": len(path), "turn_spans": spans, "drift": False,
                            # turns cut at max_new_tokens (a tool call cut off is lost)
                            "truncated_turns": sum(c.stop_reason == StopReason.LENGTH
                                                   for c in path)})
