"""The VLM examples: on a tiny SmolVLM-shaped model built by build_model.py and
pretrain_vision.py, the alignment SFT trains the connector alone, the second SFT the
language model and connector (answers alone, or worked answers), and GRPO from its folder
runs two steps whose first trainer log-probs equal the server's; the GPU sibling builds its
workflow."""

import json
from pathlib import Path

import pytest
import torch
from example_scripts import folder_weights as weights
from example_scripts import load_example

from asyncrl.config import load_config
from asyncrl.config.offline import SFTConfig
from asyncrl.controller.rl import train
from asyncrl.data.visual_tasks import generate, hf_image_tasks, worked_answer
from asyncrl.models.tiny import make_tiny_model
from asyncrl.observe import read_stats
from asyncrl.offline import sft
from asyncrl.rewards.registry import resolve_reward_fn

pytestmark = pytest.mark.integration
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "vlm"
build_model = load_example("vlm/build_model.py")
pretrain_vision = load_example("vlm/pretrain_vision.py")
QUIET = ["stats_logger.progress_bar=false", "stats_logger.plot=false"]


def changed(before: dict, after: dict) -> set[str]:
    """The top modules (model.vision_model, model.connector, model.text_model) whose
    tensors differ."""
    assert before.keys() == after.keys()
    return {".".join(k.split(".")[:2]) for k in before if not torch.equal(before[k], after[k])}


@pytest.mark.slow  # about a minute on a loaded 2-core machine
def test_pretrain_align_sft_then_grpo_with_server_and_trainer_logprobs_equal(tmp_path):
    vlm = build_model.build(make_tiny_model(tmp_path / "lm"), tmp_path / "vlm", image_size=48,
                            patch=8, vision_hidden=32, vision_layers=1, vision_heads=2)
    built = weights(vlm)
    pretrain_vision.pretrain(vlm, steps=2, batch_size=4, train_size=16, eval_size=4)
    assert changed(built, weights(vlm)) == {"model.vision_model"}
    data, worked = tmp_path / "data", tmp_path / "worked"
    for folder, answer in ((data, lambda item: item["answer"]),
                           (worked, lambda item: worked_answer(item, canvas=48))):
        folder.mkdir()
        for split, size in (("train", 8), ("held_out", 4)):
            with open(folder / f"{split}.jsonl", "w") as f:
                for item in generate(size=size, seed=0, split=split, canvas=48):
                    f.write(json.dumps({**item, "answer": answer(item)}) + "\n")
    common = [f"cluster.fileroot={tmp_path / 'runs'}", "model.dtype=float32",
              "train_dataset.batch_size=4", "total_train_steps=2", "evaluator.freq_steps=null",
              *QUIET]
    aligned = sft_stage("shapes_align_sft_cpu.yaml", vlm, data, {"model.connector"}, common)
    # the answer alone, and the worked answer, each from the aligned folder, then GRPO
    for sft_yaml, rows, grpo_yaml in (("shapes_sft_cpu.yaml", data, "shapes_grpo_cpu.yaml"),
                                      ("shapes_worked_sft_cpu.yaml", worked,
                                       "shapes_worked_grpo_cpu.yaml")):
        warm = sft_stage(sft_yaml, aligned, rows, {"model.connector", "model.text_model"},
                         common)
        grpo_two_steps(grpo_yaml, warm, tmp_path / "runs")


def sft_stage(yaml: str, start: Path, rows: Path, trained: set[str], common: list[str]) -> Path:
    """Two SFT steps of `yaml` from `start` on `rows`: the held-out loss moves and only the
    `trained` modules change. The saved folder."""
    cfg = load_config(EXAMPLES / yaml, [f"model.path={start}", f"train_dataset.path={rows}",
                                        f"valid_dataset.path={rows}", *common],
                      schema=SFTConfig)
    summary = sft.train(cfg)
    assert summary["eval_after"]["loss"] != summary["eval_before"]["loss"]
    assert changed(weights(start), weights(summary["model_dir"])) == trained, yaml
    return Path(summary["model_dir"])


def grpo_two_steps(yaml: str, start: Path, fileroot: Path) -> None:
    """Two GRPO steps of `yaml` from `start`: the trainer's first log-probs equal the
    server's, and each step's 2 prompts x 8 samples are scored 0 or 1."""
    cfg = load_config(EXAMPLES / yaml, [
        f"cluster.fileroot={fileroot}", f"actor.path={start}",
        "actor.dtype=float32", "local_engine.dtype=float32", "local_engine.max_batch_size=16",
        "gconfig.max_new_tokens=4", "train_dataset.size=16", "train_dataset.batch_size=2",
        "valid_dataset.size=2", "valid_dataset.task_kwargs.held_out_size=3",
        "total_train_steps=2", "rollout.max_head_offpolicyness=0",
        # the 2-step model's groups may all score 0, which dynamic sampling would drop
        "rollout.dynamic_sampling=false",
        "scheduler.inference_threads=1", "scheduler.trainer_threads=1", *QUIET])
    run = Path(train(cfg)["run_dir"])
    rows = read_stats(run / "stats.jsonl")
    # the held-out evaluation before training runs beside the first steps
    assert sorted(r["kind"] for r in rows) == ["eval", "eval", "train", "train"], yaml
    for row in (r for r in rows if r["kind"] == "eval"):  # each split's new scenes apart
        assert (row["eval/task/visual_shapes/n"], row["eval/task/visual_shapes_held_out/n"],
                row["eval/n"]) == (2, 3, 5)
    first = min((r for r in rows if r["kind"] == "train"), key=lambda r: r["step"])
    # exp(trainer's - server's log-prob) on every sampled token of the first step
    assert abs(first["train/imp_weight_max"] - 1) < 1e-4
    assert abs(first["train/imp_weight_min"] - 1) < 1e-4
    batches = [json.loads(line) for line in (run / "batches.jsonl").open()]
    assert [len(b["rewards"]) for b in batches] == [16, 16]  # 2 prompts x 8 samples
    assert all(r in (0.0, 1.0) for b in batches for r in b["rewards"])


def test_the_gpu_sibling_names_an_hf_image_dataset_and_a_known_reward():
    cfg = load_config(EXAMPLES / "qwen2_5_vl_clevr_grpo.yaml")
    assert callable(resolve_reward_fn(cfg.workflow.reward_fn))
    for dataset in (cfg.train_dataset, cfg.valid_dataset):
        assert dataset.path == "python:asyncrl.data.visual_tasks:hf_image_tasks"
        assert dataset.task_kwargs["dataset"] == "BUAADreamer/clevr_count_70k"
        assert callable(hf_image_tasks)
