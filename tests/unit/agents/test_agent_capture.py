"""Conversation capture: tree merge, drift fallback, discounted returns, variable groups."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncrl.agents.capture import Completion, export, parents, returns
from asyncrl.agents.online import OnlineAdmission, TaskBaseline
from asyncrl.agents.runner import parse_reward_line, resolve_agent
from asyncrl.agents.session import SessionStatus, SessionStore
from asyncrl.algorithms.advantages import normalize
from asyncrl.api.types import Batch, ImageInputs, StopReason, Trajectory
from asyncrl.models.tiny import CHATML_TEMPLATE, make_tiny_tokenizer
from asyncrl.openai.drift import check_template_drift


def comp(cid: str, prompt: list[int], output: list[int], reward: float | None = None,
         version: int = 0) -> Completion:
    return Completion(id=cid, prompt_ids=prompt, output_ids=output,
                      logprobs=[-float(t) / 100 for t in output], versions=[version] * len(output),
                      stop_reason=StopReason.STOP, reward=reward)


def test_returns_discount_backwards_over_turns():
    assert returns([None, None, 1.0], 0.5) == [0.25, 0.5, 1.0]
    assert returns([0.5, None, 1.0], 0.5) == [0.75, 0.5, 1.0]


def test_a_branching_conversation_gives_one_trajectory_per_leaf():
    # a: [1,2] -> [3]; b extends a: [1,2,3,9] -> [4]; c also extends a: [1,2,3,8] -> [5];
    # d extends b: [1,2,3,9,4,7] -> [6]. Leaves: c and d.
    cs = [comp("a", [1, 2], [3]), comp("b", [1, 2, 3, 9], [4]), comp("c", [1, 2, 3, 8], [5]),
          comp("d", [1, 2, 3, 9, 4, 7], [6], reward=1.0)]
    assert parents(cs) == ([None, 0, 0, 1], [None] * 4)  # nothing drifted
    out = export(cs, style="tree", discount=1.0, group_id="g")
    assert (out.merged, out.drift) == (3, 0)
    c_traj, d_traj = out.trajectories
    assert c_traj.input_ids == [1, 2, 3, 8, 5] and c_traj.loss_mask == [0, 0, 1, 0, 1]
    assert d_traj.input_ids == [1, 2, 3, 9, 4, 7, 6]
    assert d_traj.loss_mask == [0, 0, 1, 0, 1, 0, 1]
    assert d_traj.behavior_logprobs == [0, 0, -0.03, 0, -0.04, 0, -0.06]
    assert d_traj.versions == [-1, -1, 0, -1, 0, -1, 0]
    assert d_traj.meta["completion_ids"] == ["a", "b", "d"] and d_traj.meta["n_turns"] == 3
    # G (discount 1, reward on d only) is 1.0 for every completion made before d.
    assert c_traj.reward == 1.0 and d_traj.reward == 1.0


def test_turns_cut_at_max_new_tokens_are_counted_per_trajectory():
    from asyncrl.controller.rollout.controller import frac_truncated_turns
    # a -> b -> c along one conversation; a and c were cut at max_new_tokens, b stopped.
    cs = [comp("a", [1, 2], [3]), comp("b", [1, 2, 3, 9], [4]),
          comp("c", [1, 2, 3, 9, 4, 7], [6], reward=1.0)]
    cs[0].stop_reason = cs[2].stop_reason = StopReason.LENGTH
    (merged,) = export(cs, style="tree", discount=1.0, group_id="g").trajectories
    assert (merged.meta["n_turns"], merged.meta["truncated_turns"]) == (3, 2)
    # Exported one by one, each completion counts itself.
    alone = export(cs, style="individual", discount=1.0, group_id="g").trajectories
    assert [t.meta["truncated_turns"] for t in alone] == [1, 0, 1]
    # A trajectory without the key (an RLVR answer) counts its own stop reason.
    plain = Trajectory(input_ids=[1, 2], loss_mask=[0, 1], behavior_logprobs=[0.0, -0.1],
                       versions=[-1, 0], reward=0.0, group_id="g",
                       stop_reason=StopReason.LENGTH)
    # 2 of the merged trajectory's 3 calls, and the plain one's only call: 3 of 4.
    assert frac_truncated_turns([merged, plain]) == 0.75
    assert frac_truncated_turns(alone) == 2 / 3


def test_n_choices_of_one_prompt_are_sibling_roots_not_drift():
    cs = [comp("a", [1, 2], [3]), comp("b", [1, 2], [4])]
    out = export(cs, style="tree", discount=1.0, group_id="g")
    assert (len(out.trajectories), out.merged, out.drift) == (2, 0, 0)


def test_a_rewritten_history_is_drift_and_exported_alone():
    cs = [comp("a", [1, 2], [3]), comp("b", [1, 2, 30, 7], [4], reward=1.0)]
    assert parents(cs) == ([None, None], [None, 0])  # b continues a's conversation
    out = export(cs, style="tree", discount=0.9, group_id="g")
    assert (len(out.trajectories), out.merged, out.drift) == (2, 0, 1)
    # Both pieces carry what the conversation earned from its first turn: 0.9 * 1.0.
    assert [t.reward for t in out.trajectories] == [pytest.approx(0.9)] * 2
    assert [t.meta["drift"] for t in out.trajectories] == [False, True]


def test_turns_after_a_drift_merge_and_earn_the_conversations_return():
    # a; b continues a but re-renders its output (drift); c extends b token for token.
    cs = [comp("a", [1, 2], [3]), comp("b", [1, 2, 30, 7], [4]),
          comp("c", [1, 2, 30, 7, 4, 8], [5], reward=1.0)]
    out = export(cs, style="tree", discount=0.5, group_id="g")
    assert (len(out.trajectories), out.merged, out.drift) == (2, 1, 1)
    # G = [0.25, 0.5, 1.0]: the piece [b, c] gets G_0 like [a], not G_1.
    assert [t.reward for t in out.trajectories] == [0.25, 0.25]
    assert [t.meta["turns"] for t in out.trajectories] == [[0], [1, 2]]


def test_individual_style_keeps_every_completion():
    cs = [comp("a", [1, 2], [3]), comp("b", [1, 2, 3, 9], [4], reward=2.0)]
    out = export(cs, style="individual", discount=0.5, group_id="g")
    assert [t.input_ids for t in out.trajectories] == [[1, 2, 3], [1, 2, 3, 9, 4]]
    assert [t.reward for t in out.trajectories] == [1.0, 2.0]


def test_drift_check_catches_a_template_that_rewrites_assistant_turns():
    tok = make_tiny_tokenizer()
    assert check_template_drift(tok, native_tools=False).ok
    tok.chat_template = CHATML_TEMPLATE.replace(
        "message['content']", "(message['content'] | upper if message['role'] == 'assistant' "
        "else message['content'])")
    report = check_template_drift(tok, native_tools=False)
    # The three turns with lower-case letters (the tool calls) drift; "7", "11" and
    # "17 * 23 = 391." upper-case to themselves.
    assert (report.turns, report.drifted) == (6, 3) and "differs at token" in report.examples[0]


def test_groups_of_different_sizes_normalise_within_their_group():
    # Group 0: rewards [1, 0, 0] (mean 1/3), group 1: [1, 1] (mean 1): population std.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    groups = Batch([Trajectory(input_ids=[1], loss_mask=[1], behavior_logprobs=[0.0],
                               versions=[0], reward=float(r), group_id=g)
                    for r, g in zip(rewards, "aaabb")]).to_tensors().group_index
    assert groups.tolist() == [0, 0, 0, 1, 1]
    out = normalize(rewards, mean_level="group", std_level="group", groups=groups, eps=0.0)
    std = (2 / 9) ** 0.5  # sqrt(((2/3)^2 + 2 * (1/3)^2) / 3)
    assert out[:3].tolist() == pytest.approx([(2 / 3) / std, -(1 / 3) / std, -(1 / 3) / std])
    assert out[3:].isnan().all()  # std 0 with eps 0: the caller's eps decides (default 1e-5)
    out = normalize(rewards, mean_level="group", std_level="none", groups=groups)
    assert out.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0])


def test_task_baseline_is_the_running_mean_of_earlier_sessions():
    b = TaskBaseline()
    assert b.baseline("x") == 0.0
    b.update("x", 1.0)
    b.update("x", 0.0)
    b.update("y", 1.0)
    assert b.baseline("x") == 0.5 and b.baseline("y") == 1.0
    assert b.baseline("new") == pytest.approx(2 / 3)  # all tasks while this one has none


def test_online_admission_subtracts_the_baseline_and_rejects_unrewarded_sessions():
    class Controller:  # start_external as the rollout controller does it, minus the bound
        def __init__(self):
            self.runs = []

        def start_external(self, make):
            handle, run = make(3)
            self.runs.append(run)
            return handle

    async def main():
        store, controller = SessionStore(), Controller()
        adm = OnlineAdmission(controller, lambda s: export(
            s.completions, style="tree", discount=1.0, group_id=s.id).trajectories,
            baseline=TaskBaseline())
        out = []
        for reward in (1.0, 0.0, None):
            s = adm.admit(lambda v: store.start(task_id="t", start_version=v))
            assert s.start_version == 3
            s.completions.append(comp(f"{s.id}-0", [1], [2]))
            if reward is not None:
                s.set_reward(reward)
            store.end(s, SessionStatus.ENDED)
            out.append(await controller.runs[-1]())
        return out, adm

    (first, second, third), adm = asyncio.run(main())
    assert first[0].reward == 1.0 and first[0].meta["baseline"] == 0.0
    assert second[0].reward == -1.0 and second[0].meta["raw_reward"] == 0.0
    assert third is None and adm.counts["no_reward"] == 1


def test_reward_lines_and_agent_specs(tmp_path):
    assert parse_reward_line("log\n0.5\n") == 0.5
    assert parse_reward_line('x\n{"reward": 1}\n\n') == 1.0
    assert parse_reward_line("done") is None and parse_reward_line('{"reward": true}') is None
    path = tmp_path / "my_agent.py"
    path.write_text("async def run(base_url, api_key, item):\n    return 1.0\n"
                    "def sync(base_url, api_key, item):\n    return 1.0\n")
    fn = resolve_agent(f"{path}:run")
    assert asyncio.run(fn("u", "k", {})) == 1.0
    with pytest.raises(ValueError, match="must be an async function"):
        resolve_agent(f"{path}:sync")
    with pytest.raises(ValueError, match="does not exist"):
        resolve_agent(f"{tmp_path}/none.py:run")
    with pytest.raises(ValueError, match="must look like"):
        resolve_agent("no_colon")


def test_sandboxed_runs_record_their_isolation_in_the_session_context():
    from asyncrl.agents.sandbox import Sandbox, isolation_seen

    async def main():
        seen: set[str] = set()
        isolation_seen.set(seen)
        result = await Sandbox().run_python("print(6 * 7)")
        return seen, result

    seen, result = asyncio.run(main())
    assert result.stdout.strip() == "42"
    assert seen == set(result.isolation) and "rlimits" in seen


def test_evaluation_counts_each_agent_session_once():
    from asyncrl.controller.rollout.evaluate import evaluate

    class TwoPieces:  # a session whose second turn drifted: two trajectories, G_0 first
        async def run(self, engine, item):
            return [Trajectory(input_ids=[1, 2], loss_mask=[0, 1], behavior_logprobs=[0, 0],
                               versions=[-1, 0], reward=r, group_id="g",
                               meta={"session_id": f"s{item['id']}"}) for r in (0.5, 1.0)]

    result = asyncio.run(evaluate(None, TwoPieces(), [{"id": 1}, {"id": 2}], concurrency=2))
    stats = result.stats
    assert (stats["eval/n"], stats["eval/reward"], len(result.trajectories)) == (2.0, 0.5, 4)
    assert stats["eval/pass@1"] == 0.0 and stats["eval/mean@1"] == 0.5


def test_a_turn_with_equal_ids_but_other_pixels_is_not_merged_into_the_conversation():
    def tiles(value: float, n: int) -> ImageInputs:
        return ImageInputs(pixel_values=torch.full((n, 3, 4, 4), value))

    def completion(cid: str, prompt: list[int], images: ImageInputs) -> Completion:
        return Completion(id=cid, prompt_ids=prompt, output_ids=[7, 8], logprobs=[-1.0, -1.0],
                          versions=[0, 0], stop_reason=StopReason.STOP, images=images)

    first = completion("a", [1, 9, 9, 2], tiles(0.5, 1))
    same = completion("b", [1, 9, 9, 2, 7, 8, 3, 9, 4], ImageInputs.cat([tiles(0.5, 1),
                                                                         tiles(0.1, 1)]))
    other = completion("c", [1, 9, 9, 2, 7, 8, 3, 9, 4], ImageInputs.cat([tiles(-0.5, 1),
                                                                          tiles(0.1, 1)]))
    assert parents([first, same]) == ([None, 0], [None, None])
    assert parents([first, other]) == ([None, None], [None, None])
    (merged,) = export([first, same], style="tree", discount=1.0, group_id="g").trajectories
    assert merged.images is same.images and merged.loss_mask == [0] * 4 + [1, 1] + [0] * 3 + [1, 1]
