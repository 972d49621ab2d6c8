"""The one evaluator: per-item pass@k, maj@k, mean@k from a workflow's samples; the
`asyncrl eval` options it refuses; its table and outputs."""

import asyncio
import json
from pathlib import Path

import pytest

from asyncrl.api import Trajectory
from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.config.schema import DatasetConfig
from asyncrl.controller.evaluation import EvalSpec, EvalSpecError, table, write_outputs
from asyncrl.controller.rl import eval_concurrency, eval_in_flight
from asyncrl.controller.rollout.evaluate import evaluate
from asyncrl.observe.stats import by_task
from asyncrl.rewards.gsm8k import extract_final_answer

# Each item's samples (completion, reward), as a workflow with n = 4 returns them.
SAMPLES = {
    "a": [("#### 4", 1.0), ("#### 5", 0.0), ("#### 4", 1.0), ("no answer", 0.0)],
    "b": [("#### 7", 0.0), ("#### 7", 0.0), ("#### 9", 1.0), ("#### 7", 0.0)],
    "c": [("#### 1", 0.0), ("#### 2", 0.0), ("#### 3", 0.0), ("#### 4", 0.0)],
}


class Scripted:
    """A workflow answering each item with its scripted samples."""

    async def run(self, engine, item):
        if item["id"] == "broken":
            raise RuntimeError("the server is gone")
        return [Trajectory(input_ids=[1, 2, 3], loss_mask=[0, 1, 1], behavior_logprobs=[0] * 3,
                           versions=[-1, 0, 0], reward=r, group_id=item["id"],
                           meta={"completion": text})
                for text, r in SAMPLES[item["id"]]]


def run_scripted(ids, ks):
    return asyncio.run(evaluate(None, Scripted(), [{"id": i} for i in ids], concurrency=2,
                                ks=ks, extract_answer=extract_final_answer))


def test_scores_each_item_by_hand_and_averages_over_items():
    result = run_scripted(["a", "b", "c"], ks=(1, 2, 4))
    by_id = {s.item["id"]: s.scores for s in result.items}
    # a: 2 of 4 correct. pass@2 = 1 - C(2,2)/C(4,2) = 5/6. Votes over 4: "4" twice -> 1.
    assert by_id["a"]["pass@1"] == pytest.approx(0.5)
    assert by_id["a"]["pass@2"] == pytest.approx(5 / 6)
    assert (by_id["a"]["pass@4"], by_id["a"]["maj@4"], by_id["a"]["mean@2"]) == (1.0, 1.0, 0.5)
    # b: 1 of 4. pass@2 = 1 - C(3,2)/C(4,2) = 1/2. maj@4: "7" three times -> 0; maj@1 "7" -> 0
    assert by_id["b"]["pass@2"] == pytest.approx(0.5)
    assert (by_id["b"]["maj@4"], by_id["b"]["maj@1"], by_id["b"]["mean@4"]) == (0.0, 0.0, 0.25)
    assert by_id["c"]["pass@4"] == 0.0
    stats = result.stats
    assert stats["eval/pass@2"] == pytest.approx((5 / 6 + 0.5 + 0) / 3)
    assert stats["eval/maj@4"] == pytest.approx(1 / 3)
    assert stats["eval/reward"] == pytest.approx(3 / 12)  # every sample's reward
    assert (stats["eval/n"], stats["eval/failed"]) == (3.0, 0.0)
    assert [s.answers for s in result.items if s.item["id"] == "a"] == [["4", "5", "4", None]]


def test_a_failed_item_is_counted_and_left_out_of_the_means():
    result = run_scripted(["a", "broken"], ks=(1,))
    assert (result.stats["eval/n"], result.stats["eval/failed"]) == (1.0, 1.0)
    assert result.stats["eval/pass@1"] == pytest.approx(0.5)


def test_a_set_of_several_tasks_reports_each_tasks_scores():
    items = [{"id": "a", "task": "x"}, {"id": "b", "task": "y"}, {"id": "c", "task": "y"}]
    result = asyncio.run(evaluate(None, Scripted(), items, concurrency=2, ks=(1, 2),
                                  extract_answer=extract_final_answer))
    stats = result.stats
    assert [(r["id"], r["task"]) for r in (s.record() for s in result.items)] == [
        ("a", "x"), ("b", "y"), ("c", "y")]  # items.jsonl can be split by task
    # x: item a alone, 2 of 4 right; y: b (1 of 4) and c (0 of 4)
    assert stats["eval/task/x/reward"] == pytest.approx(0.5)
    assert stats["eval/task/y/reward"] == pytest.approx(1 / 8)
    assert (stats["eval/task/x/n"], stats["eval/task/y/n"]) == (1.0, 2.0)
    assert stats["eval/task/x/pass@2"] == pytest.approx(5 / 6)
    assert stats["eval/task/y/pass@2"] == pytest.approx((0.5 + 0) / 2)
    assert stats["eval/reward"] == pytest.approx(3 / 12)
    # mean@k and maj@k read the first k samples: a's are "4" (right), "5"; b's "7", "7"
    assert by_task(stats) == {
        "x": {"reward": 0.5, "n": 1.0, "pass@1": 0.5, "pass@2": pytest.approx(5 / 6),
              "mean@1": 1.0, "mean@2": 0.5, "maj@1": 1.0, "maj@2": 1.0},
        "y": {"reward": 1 / 8, "n": 2.0, "pass@1": 1 / 8, "pass@2": 0.25, "mean@1": 0.0,
              "mean@2": 0.0, "maj@1": 0.0, "maj@2": 0.0}}
    lines = table(stats, [1, 2]).splitlines()
    assert lines[-2:] == [
        "  x: items 1, mean reward 0.5000, pass@1 0.5000, maj@1 1.0000, mean@1 1.0000, "
        "pass@2 0.8333, maj@2 1.0000, mean@2 0.5000",
        "  y: items 2, mean reward 0.1250, pass@1 0.1250, maj@1 0.0000, mean@1 0.0000, "
        "pass@2 0.2500, maj@2 0.0000, mean@2 0.0000"]


def test_a_set_of_one_task_has_no_per_task_stats():
    items = [{"id": "a", "task": "x"}, {"id": "b", "task": "x"}]
    stats = asyncio.run(evaluate(None, Scripted(), items, concurrency=2, ks=(1,))).stats
    assert by_task(stats) == {} and not any(k.startswith("eval/task/") for k in stats)


def test_without_an_extractor_there_is_no_maj_at_k():
    result = asyncio.run(evaluate(None, Scripted(), [{"id": "a"}], concurrency=1, ks=(1,)))
    assert "eval/maj@1" not in result.stats and result.stats["eval/mean@1"] == 1.0


def spec(tmp_path, **kw):
    return EvalSpec(**{"model": "m", "dataset": DatasetConfig(path="x.jsonl"), "out": tmp_path,
                       **kw})


@pytest.mark.parametrize("kw, match", [
    ({"n": 4, "ks": [1, 8], "temperature": 1.0}, "needs at least 8 samples per item; set --n >= 8"),
    ({"n": 4, "ks": [1]}, "greedy samples would all be the same answer"),
    ({"ks": [0]}, "give positive integers"),
    ({"backend": "tgi"}, "--backend 'tgi' is not one of"),
    ({"limit": 0}, "--limit 0"),
])
def test_options_that_cannot_work_are_refused_with_what_to_change(tmp_path, kw, match):
    with pytest.raises(EvalSpecError, match=match):
        spec(tmp_path, **kw)


def test_cli_refuses_a_bad_k_list_and_a_missing_dataset(capsys):
    assert main(["eval", "--model", "m", "--data", "x.jsonl", "--k", "1,four"]) == 2
    assert "--k '1,four' must be integers" in capsys.readouterr().err
    assert main(["eval", "--model", "m"]) == 2
    assert "give --data" in capsys.readouterr().err


def test_a_runs_config_gives_eval_its_stop_strings_and_flags_win(tmp_path, monkeypatch):
    from asyncrl.controller import evaluation

    seen = []
    monkeypatch.setattr(evaluation, "run", seen.append)  # the spec, without a server
    config = Path(__file__).resolve().parents[3] / "examples/code/code_grpo_cpu.yaml"
    assert main(["eval", "--model", "m", "--config", str(config), "--out", str(tmp_path)]) == 0
    assert main(["eval", "--model", "m", "--config", str(config), "--out", str(tmp_path),
                 "--stop", "END", "--stop", "\n\n"]) == 0
    assert [s.stop for s in seen] == [["```\n"], ["END", "\n\n"]]
    assert seen[0].gconfig().stop == ["```\n"]
    assert (seen[0].reward_fn, seen[0].dataset.path, seen[0].max_tokens) == \
        ("code", "python:asyncrl.data.code_tasks:held_out_tasks", 96)
    assert seen[0].dataset.size == 64  # the config's valid_dataset.size


def test_data_replaces_the_configs_dataset_and_keeps_its_prompt_and_reward(tmp_path,
                                                                           monkeypatch):
    from asyncrl.controller import evaluation

    seen = []
    monkeypatch.setattr(evaluation, "run", seen.append)
    config = Path(__file__).resolve().parents[3] / "examples/code/code_grpo_cpu.yaml"
    data = tmp_path / "problems.jsonl"
    assert main(["eval", "--model", "m", "--config", str(config), "--out", str(tmp_path),
                 "--data", str(data)]) == 0
    dataset = seen[0].dataset
    # every item of the file: the config's held-out size (64) belongs to its own dataset
    assert (dataset.path, dataset.size, dataset.task_kwargs) == (str(data), None, {})
    assert (seen[0].reward_fn, seen[0].stop, seen[0].max_tokens) == ("code", ["```\n"], 96)


def test_several_sets_from_data_flags_or_a_runs_extra_valid_datasets(tmp_path, monkeypatch):
    from asyncrl.controller import evaluation

    seen = []
    monkeypatch.setattr(evaluation, "run", seen.append)
    assert main(["eval", "--model", "m", "--out", str(tmp_path), "--data", "a.jsonl",
                 "--data", "reasoning_gym:chain_sum", "--split", "dev"]) == 0
    sets = [seen[0].dataset, *seen[0].extra_datasets]
    assert [(d.path, d.split) for d in sets] == [("a.jsonl", "dev"),
                                                  ("reasoning_gym:chain_sum", "dev")]
    config = tmp_path / "run.yaml"
    config.write_text("train_dataset: {path: train.jsonl}\n"
                      "valid_dataset: {path: math.jsonl, size: 5}\n"
                      "extra_valid_datasets:\n"
                      "  - {path: 'python:asyncrl.data.visual_tasks:held_out_tasks', size: 3, "
                      "seed: 7, task_kwargs: {canvas: 96}}\n")
    assert main(["eval", "--model", "m", "--out", str(tmp_path), "--config", str(config)]) == 0
    sets = [seen[1].dataset, *seen[1].extra_datasets]
    assert [(d.path, d.size, d.seed, d.task_kwargs) for d in sets] == [
        ("math.jsonl", 5, 0, {}),
        ("python:asyncrl.data.visual_tasks:held_out_tasks", 3, 7, {"canvas": 96})]


def test_outputs_hold_each_item_and_the_means(tmp_path, capsys):
    result = run_scripted(["a", "b"], ks=(1, 2))
    summary = write_outputs(spec(tmp_path, n=4, ks=[1, 2], temperature=1.0), result,
                            decode=lambda ids: "-".join(map(str, ids)))
    rows = [json.loads(line) for line in (tmp_path / "items.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "b"]
    assert rows[0]["prompt"] == "1"  # the tokens before the first trained one (loss mask 1)
    assert [s["answer"] for s in rows[0]["samples"]] == ["4", "5", "4", None]
    assert rows[1]["scores"]["pass@2"] == pytest.approx(0.5)
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["stats"]["eval/pass@2"] == pytest.approx((5 / 6 + 0.5) / 2)
    assert saved["spec"]["ks"] == [1, 2] and Path(summary["plot"]).stat().st_size > 0
    printed = capsys.readouterr().out
    # k=2: pass (5/6 + 1/2) / 2, maj (1 + 0) / 2, mean (1/2 + 0) / 2
    assert printed.splitlines()[2].split() == ["2", "0.6667", "0.5000", "0.2500"]


def test_table_has_a_row_per_k():
    stats = {"eval/pass@1": 0.25, "eval/mean@1": 0.25, "eval/pass@4": 0.5, "eval/mean@4": 0.3,
             "eval/n": 4.0, "eval/failed": 0.0, "eval/reward": 0.25,
             "eval/output_tokens_mean": 12.0}
    lines = table(stats, [1, 4]).splitlines()
    assert lines[0].split() == ["k", "pass@k", "mean@k"]
    assert lines[2].split() == ["4", "0.5000", "0.3000"]


def test_an_adapter_folder_is_evaluated_merged_into_its_base(tmp_path):
    """`--model` an adapter folder: the model served is W + (alpha / r) B A (by hand)."""
    import torch
    from safetensors.torch import load_file, save_file

    from asyncrl.controller.evaluation import _served_model
    from asyncrl.models.tiny import make_tiny_model

    base = make_tiny_model(tmp_path / "base")
    name = "model.layers.0.self_attn.q_proj"
    w = load_file(f"{base}/model.safetensors")[f"{name}.weight"]
    a, b = torch.randn(2, w.shape[1]), torch.randn(w.shape[0], 2)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    save_file({f"base_model.model.{name}.lora_A.weight": a,
               f"base_model.model.{name}.lora_B.weight": b},
              adapter / "adapter_model.safetensors")
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"r": 2, "lora_alpha": 8, "target_modules": ["q_proj"], "peft_type": "LORA",
         "base_model_name_or_path": base}))
    with _served_model(spec(tmp_path / "out", model=str(adapter),
                            base_urls=["http://127.0.0.1:9"])) as (path, urls):
        merged = load_file(f"{path}/model.safetensors")[f"{name}.weight"]
        torch.testing.assert_close(merged, w + 4.0 * (b @ a), atol=1e-5, rtol=1e-5)
        assert urls == ["http://127.0.0.1:9"]
    with pytest.raises(EvalSpecError, match="--base .* is for adapter folders"):
        with _served_model(spec(tmp_path / "out", model=base, base="x",
                                base_urls=["http://127.0.0.1:9"])):
            pass


@pytest.mark.parametrize("server_batch, batch_samples, expected", [
    (64, 8, 56),   # a small training batch: the rest of the servers' batch
    (32, 16, 16),  # gsm8k_grpo_cpu.yaml: 4 prompts x 4 samples on a batch of 32
    (64, 64, 32),  # the training batch fills the servers' batch: still half of it
    (64, 128, 32),
    (1, 4, 1),
])
def test_eval_concurrency_keeps_half_the_servers_batch(server_batch, batch_samples, expected):
    assert eval_concurrency(server_batch, batch_samples) == expected


CUSTOMER_SERVICE = Path(__file__).parents[3] / "examples/agents/customer_service/customer_service_cpu.yaml"


@pytest.mark.parametrize("overrides, before, beside", [
    # batch 64, 8 tasks x 4 sessions in training: 64 alone, 64 - 32 = 32 beside training
    ([], 64, 32),
    (["evaluator.max_concurrent=8"], 8, 8),
    (["evaluator.max_concurrent=48"], 48, 32),
])
def test_evaluator_max_concurrent_caps_the_items_in_flight(overrides, before, beside):
    cfg = load_config(CUSTOMER_SERVICE, ["evaluator.max_concurrent=null", *overrides])
    assert eval_in_flight(cfg, beside_training=False) == before
    assert eval_in_flight(cfg, beside_training=True) == beside


def test_evaluator_max_concurrent_below_one_is_refused():
    with pytest.raises(ValueError, match="evaluator.max_concurrent must be >= 1 or null, got 0"):
        load_config(CUSTOMER_SERVICE, ["evaluator.max_concurrent=0"])
