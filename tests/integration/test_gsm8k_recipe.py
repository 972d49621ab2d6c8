"""The GSM8K CPU recipe's chain on a tiny random model: GRPO starts from the SFT run's weights.

examples/math/gsm8k_cpu_recipe.py runs `asyncrl sft`, then `asyncrl train` with
`actor.path` set to the folder the SFT run saved. Both sides of the GRPO run must hold
those weights: its inference server (its greedy answers before training equal HF's greedy
decoding of the SFT folder, and differ from the base model's) and its trainer (the
trainer's first-step log-probs equal the server's, so their k3 KL is zero).
"""

import importlib.util
import json
from pathlib import Path

import pytest

from asyncrl.models.tiny import make_tiny_model
from asyncrl.observe import read_stats

pytestmark = pytest.mark.integration
RECIPE = Path(__file__).resolve().parents[2] / "examples" / "math" / "gsm8k_cpu_recipe.py"
NEW_TOKENS = 8


def load_recipe():
    spec = importlib.util.spec_from_file_location("gsm8k_cpu_recipe", RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def small_gsm8k(gsm8k_dir: Path, folder: Path, n_train: int, n_test: int) -> Path:
    """The first rows of GSM8K's splits, as a folder the recipe reads."""
    folder.mkdir()
    for split, n in (("train", n_train), ("test", n_test)):
        with open(gsm8k_dir / f"{split}.jsonl") as f:
            rows = [next(f) for _ in range(n)]
        (folder / f"{split}.jsonl").write_text("".join(rows))
    return folder


def hf_greedy(model_dir, questions, system_prompt):
    """Greedy answers of `model_dir` by HF `generate`, prompted as the recipe prompts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    answers = []
    for question in questions:
        ids = tokenizer.apply_chat_template(
            [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}],
            add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        answers.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return answers


@pytest.mark.slow  # ~55 s: two training runs and an inference server
def test_grpo_starts_from_the_sft_runs_saved_weights(tmp_path, gsm8k_dir):
    recipe = load_recipe()
    base = make_tiny_model(tmp_path / "base")
    data = small_gsm8k(gsm8k_dir, tmp_path / "gsm8k", n_train=8, n_test=3)
    tiny = ["scheduler.trainer_threads=1", "stats_logger.tensorboard=false"]
    recipe.main([
        "--gsm8k", str(data), "--model", base, "--fileroot", str(tmp_path / "runs"),
        "--phases", "sft,rl",
        *[f"--sft={kv}" for kv in [
            *tiny, "model.dtype=float32", "model.optimizer.lr=1e-2", "total_train_steps=2",
            "train_dataset.batch_size=4", "train_dataset.max_length=2048",
            "valid_dataset.size=2", "valid_dataset.batch_size=2"]],
        *[f"--rl={kv}" for kv in [
            *tiny, "actor.dtype=float32", "local_engine.dtype=float32",
            "scheduler.inference_threads=1", "local_engine.max_seq_len=2048",
            "train_dataset.max_length=2048", "total_train_steps=1", "gconfig.n_samples=2",
            f"gconfig.max_new_tokens={NEW_TOKENS}", "train_dataset.batch_size=2",
            "valid_dataset.size=3", "evaluator.before_training=true", "stats_logger.plot=false"]],
    ])
    record = json.loads((tmp_path / "runs" / "gsm8k-cpu-recipe" / "seed1" /
                         "recipe.json").read_text())
    sft_dir = Path(record["sft"]["model_dir"])
    rl_run = recipe.run_dir(tmp_path / "runs", "rl", 1)
    assert sft_dir == recipe.run_dir(tmp_path / "runs", "sft", 1) / "checkpoints" / "step2"
    assert Path(record["rl"]["model_dir"]) == rl_run / "checkpoints" / "step1"
    assert record["rl"]["groups"] == 2  # one step of 2 prompts

    # The server: the run's greedy answers before training are the SFT folder's.
    evaluated = [json.loads(line) for line in (rl_run / "eval" / "step0.jsonl").open()]
    by_question = {row["question"]: row["completion"] for row in evaluated}
    questions = [json.loads(line)["question"] for line in (data / "test.jsonl").open()]
    served = [by_question[q] for q in questions]
    assert served == hf_greedy(sft_dir, questions, recipe.SYSTEM_PROMPT)
    assert served != hf_greedy(base, questions, recipe.SYSTEM_PROMPT)

    # The trainer: its log-probs of the first batch equal the server's (k3 KL ~ 0; a trainer
    # on other weights than the server's gives a KL of the order of the SFT's change).
    step1 = next(r for r in read_stats(rl_run / "stats.jsonl") if r["kind"] == "train")
    assert step1["train/behav_kl"] < 1e-6


def test_recipe_commands_load_as_configs_and_chain_the_runs(tmp_path, gsm8k_dir):
    from asyncrl.config import load_config
    from asyncrl.config.offline import SFTConfig

    recipe = load_recipe()
    args = recipe.parse_args(["--gsm8k", str(gsm8k_dir), "--fileroot", str(tmp_path),
                              "--seed", "2", "--rl=total_train_steps=7"])
    cmd = recipe.sft_command(args)
    sft = load_config(cmd[cmd.index("--config") + 1], cmd[cmd.index("--config") + 2:],
                      schema=SFTConfig)
    assert (sft.total_train_epochs, sft.total_train_steps, sft.seed) == (1, 180, 2)
    assert sft.system_prompt == recipe.SYSTEM_PROMPT
    start = tmp_path / "sft-model"
    cmd = recipe.rl_command(args, start)
    rl = load_config(cmd[cmd.index("--config") + 1], cmd[cmd.index("--config") + 2:])
    assert rl.actor.path == str(start) and rl.tokenizer_path == str(start)
    # --rl's step count wins over the recipe's, and the final step is the one saved.
    assert rl.total_train_steps == rl.saver.freq_steps == 7
    assert rl.workflow.system_prompt == recipe.SYSTEM_PROMPT
    assert rl.rollout.consumer_batch_size * rl.gconfig.n_samples == 64
    assert rl.actor.reward_norm.group_size == 8


def test_saved_model_is_the_highest_step_and_missing_one_is_named(tmp_path):
    recipe = load_recipe()
    for step in (2, 10, 9):
        (tmp_path / "checkpoints" / f"step{step}").mkdir(parents=True)
    assert recipe.saved_model(tmp_path).name == "step10"  # by number, not by name
    with pytest.raises(SystemExit, match="holds no step<N> folder"):
        recipe.saved_model(tmp_path / "other")


def test_rl_signal_counts_groups_with_mixed_rewards(tmp_path):
    recipe = load_recipe()
    batches = [{"step": 1, "group_ids": ["a", "a", "b", "b"], "rewards": [1.0, 0.0, 0.0, 0.0]},
               {"step": 2, "group_ids": ["c", "c", "d", "d"], "rewards": [1.0, 1.0, 0.0, 1.0]}]
    stats = [{"kind": "eval", "step": 0},
             {"kind": "train", "step": 1, "rollout/reward": 0.25, "rollout/frac_truncated": 0.5,
              "rollout/output_tokens_mean": 100.0, "perf/step_s": 10.0},
             {"kind": "train", "step": 2, "rollout/reward": 0.75, "rollout/frac_truncated": 0.0,
              "rollout/output_tokens_mean": 50.0, "perf/step_s": 20.0}]
    (tmp_path / "batches.jsonl").write_text("".join(json.dumps(b) + "\n" for b in batches))
    (tmp_path / "stats.jsonl").write_text("".join(json.dumps(s) + "\n" for s in stats))
    # groups a (1, 0) and d (0, 1) are mixed, b (0, 0) and c (1, 1) are not; with two steps
    # a tenth of the run is one step.
    assert recipe.rl_signal(tmp_path) == {
        "groups": 4, "mixed_group_share": 0.5, "reward_first_tenth": 0.25,
        "reward_last_tenth": 0.75, "truncated_share": 0.25, "output_tokens_mean": 75.0,
        "step_s_mean": 15.0}
