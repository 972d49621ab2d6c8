"""Datasets: JSONL files and folders, reasoning-gym tasks, the item stream, chat prompts."""

from __future__ import annotations

import importlib.util
import json
import pickle
from pathlib import Path

import pytest

from asyncrl.config.schema import DatasetConfig
from asyncrl.data import (
    DatasetError,
    ItemStream,
    build_messages,
    encode_chat,
    filter_by_length,
    load_dataset,
    load_datasets,
)
from asyncrl.models.tiny import make_tiny_tokenizer

ROWS = [
    {"question": "2 + 3?", "answer": "2 + 3 = 5\n#### 5"},
    {"question": "A thousand and one?", "answer": "1000 + 1\n#### 1,001"},
    {"question": "Plain?", "answer": "7", "id": "custom", "task": "toy"},
]


def write_jsonl(path: Path, rows: list, *, raw_lines: dict[int, str] | None = None) -> Path:
    lines = [json.dumps(r) for r in rows]
    for lineno, text in (raw_lines or {}).items():
        lines[lineno - 1] = text
    path.write_text("\n".join(lines) + "\n")
    return path


# -- loading ------------------------------------------------------------------------------


def test_jsonl_file_gives_items_with_gsm8k_ground_truth(tmp_path):
    path = write_jsonl(tmp_path / "toy.jsonl", ROWS)
    items = load_dataset(DatasetConfig(path=str(path)))
    assert [i["id"] for i in items] == ["toy-1", "toy-2", "custom"]
    assert [i["answer"] for i in items] == ["5", "1001", "7"]
    assert [i["task"] for i in items] == ["toy", "toy", "toy"]
    assert items[1]["solution"] == "1000 + 1\n#### 1,001" and "solution" not in items[2]
    assert pickle.loads(pickle.dumps(items)) == items


def test_size_keeps_the_first_rows(tmp_path):
    path = write_jsonl(tmp_path / "toy.jsonl", ROWS)
    items = load_dataset(DatasetConfig(path=str(path), size=2))
    assert [i["answer"] for i in items] == ["5", "1001"]


def test_folder_is_read_by_split_and_named_after_the_folder(tmp_path):
    folder = tmp_path / "mytask"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", ROWS)
    write_jsonl(folder / "test.jsonl", ROWS[:1])
    test = load_dataset(DatasetConfig(path=str(folder), split="test"))
    assert [(i["id"], i["task"]) for i in test] == [("test-1", "mytask")]
    assert len(load_dataset(DatasetConfig(path=str(folder)))) == 3
    with pytest.raises(DatasetError, match=r"no validation\.jsonl .*'test\.jsonl', 'train\.jsonl'"):
        load_dataset(DatasetConfig(path=str(folder), split="validation"))


def test_several_sets_load_in_order_with_ids_made_unique_by_task(tmp_path):
    for name, rows in (("aime", ROWS[:2]), ("math", ROWS)):
        (tmp_path / name).mkdir()
        write_jsonl(tmp_path / name / "test.jsonl", rows)
    sets = [DatasetConfig(path=str(tmp_path / name), split="test") for name in ("aime", "math")]
    items = load_datasets(sets)
    # both folders number their rows test-1, test-2, ...; "custom" is the row's own id
    assert [(i["id"], i["task"]) for i in items] == [
        ("test-1", "aime"), ("test-2", "aime"), ("math/test-1", "math"), ("math/test-2", "math"),
        ("custom", "toy")]
    assert [i["answer"] for i in items] == ["5", "1001", "5", "1001", "7"]
    assert [i["id"] for i in load_datasets(sets, limit=1)] == ["test-1", "math/test-1"]
    # a renamed id that is still taken: the rows must change
    write_jsonl(tmp_path / "clash.jsonl", [{**ROWS[2], "id": "toy/custom"}, ROWS[2]])
    with pytest.raises(DatasetError, match=r"item id 'toy/custom' of .*clash\.jsonl' is also "
                                           r"an item of .*clash\.jsonl'"):
        load_datasets([DatasetConfig(path=str(tmp_path / "clash.jsonl"))] * 2)


def test_bad_json_line_stops_the_load_with_file_and_line_when_asked(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", ROWS, raw_lines={3: '{"question": "x", '})
    with pytest.raises(DatasetError, match=r"bad\.jsonl:3: invalid JSON"):
        load_dataset(DatasetConfig(path=str(path), bad_rows="error"))


def test_missing_key_stops_the_load_with_file_line_and_key_when_asked(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], {"question": "no answer"}])
    with pytest.raises(DatasetError, match=r"bad\.jsonl:2: missing key 'answer'"):
        load_dataset(DatasetConfig(path=str(path), bad_rows="error"))


def test_malformed_rows_are_skipped_counted_and_named_by_default(tmp_path, caplog):
    rows = [ROWS[0], {"question": "no answer"}, ROWS[1], ["not", "an", "object"],
            {"question": " ", "answer": "1"}, ROWS[2]]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    path.write_text(path.read_text() + "{oops\n")  # line 7: not JSON
    with caplog.at_level("WARNING", logger="asyncrl.data.loading"):
        items = load_dataset(DatasetConfig(path=str(path)))
    # lines 1, 3 and 6 are good; the ids keep the file's line numbers
    assert [i["id"] for i in items] == ["bad-1", "bad-3", "custom"]
    [record] = [r for r in caplog.records if "malformed" in r.getMessage()]
    message = record.getMessage()
    assert str(path) in message and "skipped 4 malformed row(s)" in message
    for part in ("line 2: missing key 'answer'", "line 4: expected a JSON object",
                 "line 5: 'question' must be a non-empty string", "line 7: invalid JSON",
                 "bad_rows=error"):
        assert part in message, part


def test_skipped_rows_beyond_five_are_counted_not_listed(tmp_path, caplog):
    path = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0]] + [{"question": "q"}] * 7)
    with caplog.at_level("WARNING", logger="asyncrl.data.loading"):
        assert len(load_dataset(DatasetConfig(path=str(path)))) == 1
    message = caplog.records[-1].getMessage()
    assert "skipped 7 malformed row(s)" in message and "line 6:" in message
    assert "line 7:" not in message and "and 2 more" in message


def test_a_file_of_only_malformed_rows_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"q": 1}, {"q": 2}])
    with pytest.raises(DatasetError, match=r"bad\.jsonl: all 2 rows are malformed .*line 1: "
                                           "missing key 'question'"):
        load_dataset(DatasetConfig(path=str(path)))


def test_bad_rows_takes_skip_or_error_only(tmp_path):
    from asyncrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="train_dataset.bad_rows"):
        load_config(None, ["train_dataset.path=x.jsonl", "train_dataset.bad_rows=ignore"])


def test_missing_local_path_is_an_error_not_a_hub_lookup(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        load_dataset(DatasetConfig(path=str(tmp_path / "nope.jsonl")))


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None,
                    reason="datasets is installed; this checks the message when it is not")
def test_hf_id_without_datasets_package_says_how_to_install():
    with pytest.raises(DatasetError, match="pip install datasets"):
        load_dataset(DatasetConfig(path="openai/gsm8k"))


def test_real_gsm8k_folder_loads_by_split(gsm8k_dir):
    items = load_dataset(DatasetConfig(path=str(gsm8k_dir), split="test", size=3))
    assert [i["answer"] for i in items] == ["18", "3", "70000"]
    assert {i["task"] for i in items} == {"gsm8k"}


def test_reasoning_gym_items_are_deterministic_for_a_seed():
    opts = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2}

    def load(seed: int) -> list[dict]:
        return load_dataset(DatasetConfig(path="reasoning_gym:chain_sum", size=4, seed=seed,
                                          task_kwargs=opts))

    first, again, other = load(5), load(5), load(6)
    assert first == again
    assert [i["question"] for i in first] != [i["question"] for i in other]
    # reasoning-gym seeds item i with seed + i: neighbouring seeds overlap, shifted by one.
    assert [i["question"] for i in first[1:]] == [i["question"] for i in other[:3]]
    assert first[0]["id"] == "chain_sum-s5-0" and first[0]["task"] == "chain_sum"
    assert first[0]["metadata"]["source_dataset"] == "chain_sum"
    assert pickle.loads(pickle.dumps(first)) == first


def test_unknown_reasoning_gym_task_is_named():
    with pytest.raises(DatasetError, match="reasoning_gym:no_such_task"):
        load_dataset(DatasetConfig(path="reasoning_gym:no_such_task", size=2))


# -- the stream ---------------------------------------------------------------------------


def items_of(n: int) -> list[dict]:
    return [{"id": str(i)} for i in range(n)]


def take(stream: ItemStream, n: int) -> list[str]:
    return [stream.next()["id"] for _ in range(n)]


def test_each_epoch_is_a_fresh_permutation():
    stream = ItemStream(items_of(10), shuffle=True, seed=0)
    epoch0, epoch1 = take(stream, 10), take(stream, 10)
    assert sorted(epoch0, key=int) == sorted(epoch1, key=int) == [str(i) for i in range(10)]
    assert epoch0 != epoch1
    assert (stream.epoch, stream.position) == (1, 10)


def test_unshuffled_stream_cycles_in_order():
    stream = ItemStream(items_of(3), shuffle=False, seed=0)
    assert take(stream, 7) == ["0", "1", "2", "0", "1", "2", "0"]
    assert (stream.epoch, stream.position) == (2, 1)


def test_resumed_stream_yields_exactly_the_same_next_items():
    original = ItemStream(items_of(5), shuffle=True, seed=42)
    take(original, 7)  # into the second epoch
    state = json.loads(json.dumps(original.state_dict()))  # survives a JSON round trip
    expected = take(original, 9)  # crosses into the third epoch
    resumed = ItemStream(items_of(5), shuffle=True, seed=42)
    resumed.load_state_dict(state)
    assert take(resumed, 9) == expected


def test_resuming_onto_a_different_dataset_is_refused():
    state = ItemStream(items_of(5), shuffle=True, seed=42).state_dict()
    with pytest.raises(ValueError, match="dataset or its config changed"):
        ItemStream(items_of(6), shuffle=True, seed=42).load_state_dict(state)


def test_steps_per_epoch_counts_full_batches():
    stream = ItemStream(items_of(10), shuffle=True, seed=0)
    assert stream.steps_per_epoch(3) == 3
    assert stream.steps_per_epoch(10) == 1
    with pytest.raises(ValueError, match="larger than the dataset"):
        stream.steps_per_epoch(11)


# -- prompts ------------------------------------------------------------------------------


def test_few_shot_examples_become_user_assistant_turns():
    messages = build_messages("3 + 4?", system_prompt="Be brief.",
                              few_shot=[{"question": "1 + 1?", "answer": "<answer>2</answer>"}])
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1 + 1?"},
        {"role": "assistant", "content": "<answer>2</answer>"},
        {"role": "user", "content": "3 + 4?"},
    ]
    with pytest.raises(ValueError, match=r"few_shot\[0\] lacks \['answer'\]"):
        build_messages("q", few_shot=[{"question": "1 + 1?", "reply": "2"}])


def test_encode_chat_ends_with_the_generation_prompt():
    tok = make_tiny_tokenizer()
    ids = encode_chat(tok, [{"role": "user", "content": "hi"}])
    assert isinstance(ids, list) and all(isinstance(t, int) for t in ids)
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # byte-level: 3 special tokens + len("user\nhi") + "\n" + len("assistant\n") = 3 + 7 + 1 + 10
    assert len(ids) == 21


def test_filter_by_length_drops_long_prompts():
    tok = make_tiny_tokenizer()

    def prompt_ids(item: dict) -> list[int]:
        return encode_chat(tok, build_messages(item["question"]))

    # Prompt length = 19 + len(question) with the byte-level tokenizer (see above).
    items = [{"question": "abc"}, {"question": "abcdefgh"}]
    assert filter_by_length(items, prompt_ids, 22) == items[:1]
    assert filter_by_length(items, prompt_ids, None) == items
    with pytest.raises(ValueError, match="all 2 prompts are longer than max_length=10"):
        filter_by_length(items, prompt_ids, 10)


class _FakeHFDataset:
    """The slice of `datasets.Dataset` that the loader uses."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    def select(self, indices):
        return _FakeHFDataset([self.rows[i] for i in indices])


def test_hf_dataset_id_is_loaded_through_the_datasets_package(monkeypatch):
    import sys
    import types

    calls = []

    def fake_load_dataset(path, split=None, **kwargs):  # datasets.load_dataset's signature
        calls.append((path, split, kwargs))
        return _FakeHFDataset([
            {"question": "2 + 2?", "answer": "Add them.\n#### 4"},
            {"question": "1,000 + 1?", "answer": "#### 1,001"},
            {"question": "unused", "answer": "#### 0"},
        ])

    monkeypatch.setitem(sys.modules, "datasets",
                        types.SimpleNamespace(load_dataset=fake_load_dataset))
    items = load_dataset(DatasetConfig(path="openai/gsm8k", split="test", size=2,
                                       task_kwargs={"name": "main"}))
    assert calls == [("openai/gsm8k", "test", {"name": "main"})]
    assert [(i["question"], i["answer"], i["task"]) for i in items] == [
        ("2 + 2?", "4", "gsm8k"), ("1,000 + 1?", "1001", "gsm8k")]


def test_a_gzipped_jsonl_file_loads_as_humaneval_ships_it(tmp_path):
    import gzip

    row = {"task_id": "HumanEval/0", "prompt": "def f():\n", "canonical_solution": "    return 1\n",
           "test": "def check(c):\n    assert c() == 1\n", "entry_point": "f"}
    path = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps(row) + "\n")
    [item] = load_dataset(DatasetConfig(path=str(path)))
    assert (item["id"], item["question"], item["task"]) == \
        ("HumanEval/0", "def f():\n", "HumanEval")
