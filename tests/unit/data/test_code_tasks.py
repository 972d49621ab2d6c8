"""The generated code tasks: tests that agree with the question's words, reference
solutions that pass, splits that share no constants, names or questions, and MBPP rows."""

import operator
import re

import pytest

from asyncrl.agents.code_reward import code_reward
from asyncrl.data.code_tasks import generate, held_out_tasks, mbpp_item, train_tasks

TRAIN = train_tasks(size=400, seed=0)
HELD_OUT = held_out_tasks(size=200, seed=0)


def test_the_same_seed_gives_the_same_items_and_another_seed_others():
    assert train_tasks(size=400, seed=0) == TRAIN
    other = train_tasks(size=400, seed=1)
    assert [i["question"] for i in other] != [i["question"] for i in TRAIN]
    assert len({i["id"] for i in TRAIN}) == 400


def test_arithmetic_tests_hold_what_the_question_says():
    ops = {"plus": operator.add, "minus": operator.sub, "times": operator.mul}
    checked = 0
    for item in TRAIN + HELD_OUT:
        m = re.search(r"`(\w+)\((\w+)\)`.* \2 (plus|minus|times) (\d+)\.$", item["question"])
        if not m:
            continue
        name, _, word, k = m.groups()
        for test in item["tests"]:
            arg, want = re.fullmatch(rf"assert {name}\((-?\d+)\) == (-?\d+)", test).groups()
            assert ops[word](int(arg), int(k)) == int(want)
            checked += 1
    assert checked > 50


def test_every_reference_solution_passes_its_own_tests():
    for item in TRAIN + HELD_OUT:
        scope: dict = {}
        exec(item["answer"], scope)  # noqa: S102 - the generator's own reference code
        for test in item["tests"]:
            exec(test, scope)  # noqa: S102


def test_the_code_reward_scores_the_reference_1_and_a_wrong_function_0():
    for item in HELD_OUT[:2]:
        fenced = f"```python\n{item['answer']}```"
        wrong = f"```python\ndef {item['entry_point']}(x):\n    return None\n```"
        assert code_reward(fenced, item)[0] == 1.0
        assert code_reward(wrong, item)[0] == 0.0


def test_the_splits_share_no_constants_names_or_questions():
    def constants(items):
        return {int(n) for i in items for n in re.findall(r"\b(\d+)\b", i["answer"])}

    assert constants(TRAIN) - {0, 1, 2} <= set(range(2, 10))
    assert constants(HELD_OUT) - {0, 1, 2} <= set(range(11, 20))
    assert not {i["entry_point"] for i in TRAIN} & {i["entry_point"] for i in HELD_OUT}
    assert not {i["question"] for i in TRAIN} & {i["question"] for i in HELD_OUT}


def test_an_unknown_split_is_an_error_naming_it():
    with pytest.raises(ValueError, match="split 'test'"):
        generate(size=1, seed=0, split="test")


def test_an_mbpp_row_maps_to_a_tests_item():
    row = {"task_id": 11, "text": "Write a function to add two numbers.",
           "code": "def add(a, b):\n    return a + b", "test_setup_code": "import math",
           "test_list": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]}
    item = mbpp_item(row)
    assert item["id"] == "mbpp-11"
    assert item["question"] == ("Write a function to add two numbers.\nYour code should pass "
                                "this test:\nassert add(1, 2) == 3")
    assert item["tests"] == ["import math\nassert add(1, 2) == 3",
                             "import math\nassert add(2, 2) == 4"]
    assert code_reward(f"```python\n{row['code']}\n```", item)[0] == 1.0
    assert code_reward("def add(a, b):\n    return 3\n", item)[0] == 0.5
