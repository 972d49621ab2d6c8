"""`asyncrl eval` end to end: a server it starts, and its scores checked against the samples
it wrote (rewards recomputed, pass@k by enumeration); GSM8K correctness against math-verify
on SmolLM2's answers."""

from __future__ import annotations

import itertools
import json
from fractions import Fraction

import pytest
from toy_rewards import first_word, hash_parity

from asyncrl.cli import main
from asyncrl.models.tiny import make_tiny_model

GSM8K = "../shared/data/gsm8k/test.jsonl"  # relative to the repo root, where pytest runs


def brute_force_pass_at_k(correct: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(correct, k))
    return float(Fraction(sum(any(s) for s in subsets), len(subsets)))


def write_items(path, n):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"q{i}", "question": f"Say something about {i}.",
                                "answer": "0"}) + "\n")


@pytest.mark.slow
def test_eval_scores_equal_those_recomputed_from_its_samples(tmp_path):
    model = make_tiny_model(tmp_path / "tiny")
    write_items(tmp_path / "items.jsonl", 6)
    out = tmp_path / "out"
    rc = main(["eval", "--model", model, "--data", str(tmp_path / "items.jsonl"), "--k", "1,2,4",
               "--temperature", "1.0", "--max-tokens", "6", "--reward",
               "toy_rewards:hash_parity", "--answer-fn", "toy_rewards:first_word", "--out",
               str(out), "--threads", "1", "--dtype", "float32", "--max-seq-len", "256",
               "--no-progress", "--limit", "5"])
    assert rc == 0
    rows = [json.loads(line) for line in (out / "items.jsonl").read_text().splitlines()]
    assert len(rows) == 5
    for row in rows:
        samples = row["samples"]
        assert len(samples) == 4
        rewards = [hash_parity(s["completion"], {}) for s in samples]
        assert [s["reward"] for s in samples] == rewards
        assert [s["answer"] for s in samples] == [first_word(s["completion"]) for s in samples]
        for k in (1, 2, 4):
            assert row["scores"][f"pass@{k}"] == pytest.approx(
                brute_force_pass_at_k([r == 1.0 for r in rewards], k))
            assert row["scores"][f"mean@{k}"] == pytest.approx(sum(rewards[:k]) / k)
    stats = json.loads((out / "summary.json").read_text())["stats"]
    for name in ("pass@2", "maj@4", "mean@4"):
        assert stats[f"eval/{name}"] == pytest.approx(
            sum(r["scores"][name] for r in rows) / len(rows))
    assert (out / "pass_at_k.png").stat().st_size > 0


def answer_line(completion: str) -> str:
    """The completion up to the end of the line that holds its last '####'."""
    at = completion.rfind("####")
    end = completion.find("\n", at)
    return completion if end < 0 else completion[:end]


@pytest.mark.slow
def test_gsm8k_correctness_equals_math_verify_on_smollm2_answers(tmp_path):
    """Each sample's reward equals math-verify's own verdict: its parse of the answer line
    against its parse of the gold answer; a sample with no '####' or \\boxed scores 0."""
    from math_verify import parse, verify

    few_shot = tmp_path / "few_shot.json"
    few_shot.write_text(json.dumps([{
        "question": "Tom has 3 apples and buys 5 more. How many apples does he have?",
        "answer": "Tom has 3 + 5 = 8 apples.\n#### 8"}]))
    out = tmp_path / "out"
    rc = main(["eval", "--model", "smollm2-135m-instruct", "--data", GSM8K, "--limit", "16",
               "--k", "1,4", "--temperature", "0.8", "--max-tokens", "160",
               "--few-shot", str(few_shot), "--system-prompt", "Solve the problem step by "
               "step and end with #### followed by the final answer.", "--out", str(out),
               "--threads", "1", "--no-progress"])
    assert rc == 0
    rows = [json.loads(line) for line in (out / "items.jsonl").read_text().splitlines()]
    formatted = 0
    for row in rows:
        gold = parse("$" + row["gold"] + "$")
        for s in row["samples"]:
            text = s["completion"]
            if "####" not in text and "\\boxed" not in text:
                assert s["reward"] == 0.0 and s["answer"] is None, text
                continue
            formatted += 1
            theirs = bool(verify(gold, parse(answer_line(text))))
            assert (s["reward"] == 1.0) == theirs, (text, row["gold"], s["answer"])
    assert formatted >= 16  # SmolLM2 follows the format in ~2 of 3 samples
