"""Offline rows: SFT and preference JSONL to tokens with loss masks, and bad rows explained."""

import json
import re

import pytest
import torch

from asyncrl.config.offline import OfflineDatasetConfig
from asyncrl.data import DatasetError
from asyncrl.data.offline import (
    TokenRow,
    collate,
    load_preference_examples,
    load_sft_examples,
)
from asyncrl.models.tiny import make_tiny_tokenizer

END = "<|im_end|>\n"  # ChatML end of turn: learned with the answer, so the model stops


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def learned(tok, row: TokenRow) -> str:
    return tok.decode([t for t, m in zip(row.input_ids, row.loss_mask) if m])


def given(tok, row: TokenRow) -> str:
    return tok.decode([t for t, m in zip(row.input_ids, row.loss_mask) if not m])


def sft(tmp_path, tok, rows, **cfg):
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    system = cfg.pop("system_prompt", None)
    return load_sft_examples(OfflineDatasetConfig(path=str(path), **cfg), tok, system)


def test_prompt_answer_row_learns_the_answer_and_its_end_of_turn_only(tmp_path, tok):
    [[row]] = sft(tmp_path, tok, [{"prompt": "2+2?", "answer": "4"}], system_prompt="Be brief.")
    assert tok.decode(row.input_ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                                         "<|im_start|>user\n2+2?<|im_end|>\n"
                                         "<|im_start|>assistant\n4<|im_end|>\n")
    assert learned(tok, row) == "4" + END
    # One token per byte, one per special token. Given: system turn 1 + 7 ("system\n") + 9
    # ("Be brief.") + 2 = 19, user turn 1 + 5 + 4 + 2 = 12, "<|im_start|>assistant\n" 11:
    # 42 tokens. Learned: "4", "<|im_end|>", "\n": 3 tokens.
    assert row.loss_mask == [0] * 42 + [1] * 3


def test_completion_key_and_message_list_prompts_are_accepted(tmp_path, tok):
    rows = [{"prompt": "hi", "completion": "hello"},
            {"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                        {"role": "user", "content": "c"}], "completion": "d"}]
    [[first], [second]] = sft(tmp_path, tok, rows)
    assert learned(tok, first) == "hello" + END
    assert learned(tok, second) == "d" + END  # the prompt's assistant turn "b" is given


def test_chat_row_learns_every_assistant_turn(tmp_path, tok):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"},
                {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
                {"role": "assistant", "content": "a2"}]
    [[row]] = sft(tmp_path, tok, [{"messages": messages}], system_prompt="ignored")
    assert learned(tok, row) == "a1" + END + "a2" + END
    assert "ignored" not in tok.decode(row.input_ids)  # chat rows carry their own system turn
    assert given(tok, row).endswith("<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n")


def test_gsm8k_row_learns_the_whole_solution(tmp_path, tok, gsm8k_dir):
    [[row]] = load_sft_examples(OfflineDatasetConfig(path=str(gsm8k_dir), size=1), tok)
    first = json.loads((gsm8k_dir / "train.jsonl").read_text().splitlines()[0])
    assert learned(tok, row) == first["answer"] + END
    assert first["question"] in given(tok, row)


def test_preference_row_gives_a_chosen_then_rejected_pair(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "Capital of France?", "chosen": "Paris", "rejected": "Rome"},
        {"prompt": [{"role": "user", "content": "q"}],
         "chosen": [{"role": "assistant", "content": "yes"}],
         "rejected": [{"role": "assistant", "content": "no"}]}])
    pairs = load_preference_examples(OfflineDatasetConfig(path=str(path)), tok)
    (chosen, rejected), (c2, r2) = pairs
    assert (chosen.label, rejected.label) == (1.0, 0.0)
    assert (learned(tok, chosen), learned(tok, rejected)) == ("Paris" + END, "Rome" + END)
    assert given(tok, chosen) == given(tok, rejected)  # the same prompt
    assert (learned(tok, c2), learned(tok, r2)) == ("yes" + END, "no" + END)


def test_whole_conversation_pairs_learn_only_what_follows_their_shared_turns(tmp_path, tok):
    # TRL's implicit prompt: no "prompt" key; the common first messages are the prompt.
    head = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hey"},
            {"role": "user", "content": "q"}]
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"chosen": head + [{"role": "assistant", "content": "yes"}],
         "rejected": head + [{"role": "assistant", "content": "no"}]}])
    [(chosen, rejected)] = load_preference_examples(OfflineDatasetConfig(path=str(path)), tok)
    # The shared assistant turn "hey" is given, not learned.
    assert (learned(tok, chosen), learned(tok, rejected)) == ("yes" + END, "no" + END)
    assert given(tok, chosen) == given(tok, rejected)


def test_size_keeps_the_first_rows_and_max_length_drops_long_examples(tmp_path, tok):
    rows = [{"prompt": "p", "answer": "x" * n} for n in (1, 50, 2, 3)]
    assert len(sft(tmp_path, tok, rows, size=2)) == 2
    # The prompt "p" renders to 1 + 5 ("user\n") + 1 + 2 + 1 + 10 ("assistant\n") = 20
    # tokens; an n-byte answer adds n + 2 (end of turn): 23, 72, 24, 25 tokens.
    kept = sft(tmp_path, tok, rows, max_length=60)
    assert [len(ex[0].input_ids) for ex in kept] == [23, 24, 25]
    with pytest.raises(DatasetError, match="all 4 examples .* longer than max_length=10"):
        sft(tmp_path, tok, rows, max_length=10)


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "p", "answer": ', "invalid JSON"),
    ('["prompt", "answer"]', "expected a JSON object, got list"),
    ({"prompt": "p"}, "missing key 'answer' \\(or 'completion'\\)"),
    ({"prompt": "", "answer": "a"}, "'prompt' must be a non-empty string"),
    ({"prompt": "p", "answer": 3}, "'answer' must be a non-empty string"),
    ({"messages": [{"role": "user", "content": "q"}]}, "no assistant turn"),
    ({"messages": [{"role": "robot", "content": "q"}]}, "messages\\[0\\] has role 'robot'"),
    ({"messages": [{"role": "user"}]}, "messages\\[0\\] must be"),
    ({"prompt": "p", "chosen": "a", "rejected": "b"}, "train it with `asyncrl dpo`"),
    ({"text": "raw"}, "cannot tell the row's format from its keys \\['text'\\]"),
], ids=["json", "not_object", "no_answer", "empty_prompt", "number", "no_assistant",
        "bad_role", "no_content", "preference_row", "unknown_shape"])
def test_malformed_sft_rows_name_the_file_and_line(tmp_path, tok, caplog, line, message):
    good = {"prompt": "p", "answer": "a"}
    rows = [good, "", line, good]  # line 2 is blank: skipped, still counted
    with pytest.raises(DatasetError, match=rf"d\.jsonl:3: .*{message}"):
        sft(tmp_path, tok, rows, bad_rows="error")
    # By default the row is left out, and one warning names it.
    with caplog.at_level("WARNING"):
        assert len(sft(tmp_path, tok, rows)) == 2
    [warning] = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert re.search(rf"skipped 1 malformed row\(s\) \(.*d\.jsonl:3: .*{message}", warning)
    assert "bad_rows=error" in warning


def test_skipped_rows_are_counted_and_the_first_five_named(tmp_path, tok, caplog):
    rows = [{"prompt": "p", "answer": "a"}] + ['{"broken'] * 7
    with caplog.at_level("WARNING"):
        assert len(sft(tmp_path, tok, rows)) == 1
    [warning] = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert "skipped 7 malformed row(s)" in warning and "and 2 more" in warning
    assert [f"d.jsonl:{n}:" in warning for n in range(2, 9)] == [True] * 5 + [False] * 2


@pytest.mark.parametrize("row, message", [
    ({"prompt": "p", "chosen": "a"}, "missing \\['rejected'\\]"),
    ({"prompt": "p", "chosen": "a", "rejected": "a"}, "identical"),
    ({"prompt": "p", "chosen": [{"role": "user", "content": "x"}], "rejected": "b"},
     "'chosen' has no assistant message"),
    ({"prompt": "p", "chosen": None, "rejected": "b"}, "'chosen' must be a non-empty string"),
])
def test_malformed_preference_rows_name_the_file_and_line(tmp_path, tok, row, message):
    path = write_jsonl(tmp_path / "p.jsonl", [row])
    with pytest.raises(DatasetError, match=rf"p\.jsonl:1: .*{message}"):
        load_preference_examples(OfflineDatasetConfig(path=str(path)), tok)


def test_a_format_that_does_not_match_the_rows_is_explained(tmp_path, tok):
    with pytest.raises(DatasetError, match=r"d\.jsonl:1: .*'messages' must be"):
        sft(tmp_path, tok, [{"prompt": "p", "answer": "a"}], format="chat")


def test_missing_dataset_path_is_explained(tmp_path, tok):
    with pytest.raises(DatasetError, match="does not exist"):
        load_sft_examples(OfflineDatasetConfig(path=str(tmp_path / "nope.jsonl")), tok)
    with pytest.raises(DatasetError, match="no train.jsonl"):
        load_sft_examples(OfflineDatasetConfig(path=str(tmp_path)), tok)


def test_collate_pads_rows_and_carries_labels_and_reference_logprobs():
    rows = [TokenRow(input_ids=[5, 6, 7], loss_mask=[0, 1, 1], label=1.0,
                     ref_logprobs=torch.tensor([0.0, -1.0, -2.0])),
            TokenRow(input_ids=[8, 9], loss_mask=[0, 1], ref_logprobs=torch.tensor([0.0, -3.0]))]
    batch = collate(rows, pad_token_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7], [8, 9, 0]]
    assert batch.attention_mask.tolist() == [[True] * 3, [True, True, False]]
    assert batch.loss_mask.tolist() == [[0, 1, 1], [0, 1, 0]]
    assert batch.rewards.tolist() == [1.0, 0.0]
    assert batch.ref_logprobs.tolist() == [[0, -1, -2], [0, -3, 0]]
    rows[1].ref_logprobs = None
    with pytest.raises(ValueError, match="1 of 2 rows lack reference log-probs"):
        collate(rows, pad_token_id=0)
