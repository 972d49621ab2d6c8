"""Generated function-writing tasks with tests, easy enough for a 135M model to solve some.

Each item asks for one small Python function ("Write a Python function `add_7(x)` that
returns x plus 7.") and carries `tests`, assert statements the `code` reward runs in the
sandbox (`agents/code_reward.py`). Task families: arithmetic with a constant, parity and
divisibility, string ops (reverse, upper, lower, count a character, add a prefix or
suffix), list ops (max, min, sum, length, first, last). Constants, function names,
parameter names and test inputs are drawn from `Random(seed)`, so the model cannot
memorise answers, and the same (size, seed) gives the same items.

The two splits differ so that the held-out score measures transfer, not recall:

- constants: `train` draws them from 2..9, `held_out` from 11..19 (characters and affixes
  from disjoint alphabets too);
- wording: each family has several question phrasings and name patterns; `held_out` uses
  ones `train` never shows.

`train_tasks` and `held_out_tasks` are dataset generators
(`train_dataset.path: python:asyncrl.data.code_tasks:train_tasks`);
`mbpp_item` maps a row of MBPP (the HF dataset) to the same item format.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SPLITS = ("train", "held_out")


@dataclass(frozen=True)
class _Split:
    constants: range
    chars: str        # characters counted, prefixes and suffixes
    wording: int      # which of each family's phrasings and name patterns: 0/1 train, 2 held-out
    params: dict[str, tuple[str, ...]]  # the parameter's name, by kind of argument


_SPLIT_SPECS = {
    "train": _Split(range(2, 10), "abcdefghijklm", 0,
                    {"x": ("x", "n"), "s": ("s", "text"), "nums": ("nums", "values")}),
    "held_out": _Split(range(11, 20), "nopqrstuvwxyz", 2,
                       {"x": ("a", "num"), "s": ("word", "t"), "nums": ("items", "numbers")}),
}
_NUMBER_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven",
                 8: "eight", 9: "nine"}
_WORDS = ("apple", "banana", "hello", "python", "orange", "planet", "silver", "window",
          "garden", "rocket", "summer", "castle", "little", "yellow", "coffee", "dragon")


@dataclass(frozen=True)
class _Task:
    name: str
    signature: str      # e.g. "x" or "s"
    question: str
    solution: str       # a reference body expression over the parameter
    inputs: list[Any]


def _pick(rng: random.Random, options: list[str] | tuple[str, ...], wording: int) -> str:
    """One of `options` by split: train picks from the first two, held-out from the rest."""
    return rng.choice(options[2:] if wording == 2 else options[:2])


def _const_name(k: int) -> str:
    return _NUMBER_WORDS.get(k, str(k))


def _arith(rng: random.Random, sp: _Split) -> _Task:
    k = rng.choice(sp.constants)
    op, verb, expr = rng.choice([("add", "plus", "x + {k}"), ("sub", "minus", "x - {k}"),
                                 ("mul", "times", "x * {k}")])
    name = _pick(rng, (f"{op}_{_const_name(k)}", f"{op}_{k}", f"{op}{k}_value"), sp.wording)
    q = _pick(rng, (f"returns x {verb} {k}.", f"returns the number x {verb} {k}.",
                    f"takes an integer x and gives back x {verb} {k}."), sp.wording)
    return _Task(name, "x", q, expr.format(k=k), [rng.randint(-20, 50) for _ in range(3)])


def _parity(rng: random.Random, sp: _Split) -> _Task:
    if rng.random() < 0.5:
        name = _pick(rng, ("is_even", "even", "check_even"), sp.wording)
        q = _pick(rng, ("returns True if x is even and False otherwise.",
                        "returns whether the integer x is even.",
                        "checks an integer x and returns True exactly when it is even."),
                  sp.wording)
        return _Task(name, "x", q, "x % 2 == 0", [rng.randint(-30, 30) for _ in range(4)])
    k = rng.choice(sp.constants)
    name = _pick(rng, (f"divisible_by_{k}", f"is_multiple_of_{k}", f"check_div{k}"),
                 sp.wording)
    q = _pick(rng, (f"returns True if x is divisible by {k} and False otherwise.",
                    f"returns whether x is a multiple of {k}.",
                    f"checks an integer x and returns True exactly when {k} divides it."),
              sp.wording)
    inputs = [k * rng.randint(1, 9), k * rng.randint(1, 9) + 1, rng.randint(1, 99)]
    return _Task(name, "x", q, f"x % {k} == 0", inputs)


def _string(rng: random.Random, sp: _Split) -> _Task:
    kind = rng.choice(["reverse", "upper", "lower", "count", "prefix", "suffix"])
    words = [rng.choice(_WORDS) for _ in range(3)]
    if kind == "reverse":
        name = _pick(rng, ("reverse_string", "reverse", "flip_text", "backwards_text"), sp.wording)
        q = _pick(rng, ("returns the string s reversed.", "returns s backwards.",
                        "gives back the characters of the string s in reverse order."),
                  sp.wording)
        return _Task(name, "s", q, "s[::-1]", words)
    if kind in ("upper", "lower"):
        name = _pick(rng, (f"to_{kind}", f"make_{kind}", f"{kind}case_text", f"{kind}_all"),
                     sp.wording)
        q = _pick(rng, (f"returns the string s in {kind} case.",
                        f"converts s to {kind}case and returns it.",
                        f"gives back the string s with every letter made {kind} case."),
                  sp.wording)
        inputs = [w.capitalize() if kind == "lower" else w for w in words]
        return _Task(name, "s", q, f"s.{kind}()", inputs)
    c = rng.choice(sp.chars)
    if kind == "count":
        name = _pick(rng, (f"count_{c}", f"number_of_{c}", f"how_many_{c}s"), sp.wording)
        q = _pick(rng, (f"returns how many times the letter '{c}' appears in the string s.",
                        f"counts the occurrences of '{c}' in s and returns the count.",
                        f"gives back the number of '{c}' characters in the string s."),
                  sp.wording)
        inputs = [w + c * rng.randint(0, 2) + rng.choice(_WORDS) for w in words]
        return _Task(name, "s", q, f"s.count({c!r})", inputs)
    affix = "".join(rng.choice(sp.chars) for _ in range(3))
    where = "start" if kind == "prefix" else "end"
    name = _pick(rng, (f"add_{kind}_{affix}", f"with_{affix}", f"{kind}ed_{affix}_text"),
                 sp.wording)
    q = _pick(rng, (f"returns the string s with '{affix}' added at the {where}.",
                    f"puts '{affix}' at the {where} of s and returns the result.",
                    f"gives back s joined with '{affix}' at its {where}."), sp.wording)
    expr = f"{affix!r} + s" if kind == "prefix" else f"s + {affix!r}"
    return _Task(name, "s", q, expr, words)


def _lists(rng: random.Random, sp: _Split) -> _Task:
    kind, expr, what = rng.choice([
        ("max", "max(nums)", "the largest number"), ("min", "min(nums)", "the smallest number"),
        ("sum", "sum(nums)", "the sum of the numbers"), ("len", "len(nums)", "how many numbers"),
        ("first", "nums[0]", "the first number"), ("last", "nums[-1]", "the last number")])
    name = _pick(rng, (f"list_{kind}", f"get_{kind}", f"{kind}_of_numbers", f"find_{kind}"),
                 sp.wording)
    q = _pick(rng, (f"returns {what} in the list nums.",
                    f"takes a list of integers nums and returns {what} in it.",
                    f"gives back {what} in the non-empty list nums."), sp.wording)
    inputs = [[rng.randint(-9, 30) for _ in range(rng.randint(2, 6))] for _ in range(3)]
    return _Task(name, "nums", q, expr, inputs)


_FAMILIES: tuple[Callable[[random.Random, _Split], _Task], ...] = (
    _arith, _parity, _string, _lists)
# SmolLM2-135M-Instruct solves nearly all arithmetic and parity tasks, about half of the
# list tasks and few string tasks: these weights put its greedy score near 0.3-0.4.
_FAMILY_WEIGHTS = (2, 1, 6, 4)


def _with_param(task: _Task, rng: random.Random, sp: _Split) -> _Task:
    """`task` with its parameter renamed to one of the split's names for that kind (a quoted
    character such as 's' is not the parameter)."""
    new = rng.choice(sp.params[task.signature])
    word = re.compile(rf"(?<![\w']){task.signature}(?![\w'])")
    return dataclasses.replace(task, signature=new, question=word.sub(new, task.question),
                               solution=word.sub(new, task.solution))


def make_task(rng: random.Random, split: str) -> dict[str, Any]:
    """One task of `split` as an item without an id: question, answer, tests, entry_point."""
    if split not in _SPLIT_SPECS:
        raise ValueError(f"code task split {split!r}: use one of {SPLITS}")
    spec = _SPLIT_SPECS[split]
    task = _with_param(rng.choices(_FAMILIES, weights=_FAMILY_WEIGHTS)[0](rng, spec), rng, spec)
    fn = eval(f"lambda {task.signature}: {task.solution}")  # noqa: S307 - our own expression
    tests = [f"assert {task.name}({arg!r}) == {fn(arg)!r}" for arg in task.inputs]
    return {
        "question": f"Write a Python function `{task.name}({task.signature})` that "
                    f"{task.question}",
        "answer": f"def {task.name}({task.signature}):\n    return {task.solution}\n",
        "tests": tests,
        "entry_point": task.name,
        "task": f"code_{split}",
    }


def generate(*, size: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
    """`size` distinct tasks of `split` drawn from Random(seed) (a `python:` dataset). A
    question may come back with other tests (a list task has few wordings): distinct means
    question and tests."""
    rng = random.Random(f"{split}-{seed}")
    items: list[dict[str, Any]] = []
    seen: set[tuple[str, ...]] = set()
    for _ in range(size * 50):
        if len(items) == size:
            break
        item = make_task(rng, split)
        key = (item["question"], *item["tests"])
        if key in seen:
            continue
        seen.add(key)
        items.append({"id": f"code-{split}-s{seed}-{len(items)}", **item})
    if len(items) < size:
        raise ValueError(f"code tasks: only {len(items)} distinct {split} tasks, asked for "
                         f"{size}; ask for fewer")
    return items


def train_tasks(*, size: int, seed: int) -> list[dict[str, Any]]:
    """The training split (`python:asyncrl.data.code_tasks:train_tasks`)."""
    return generate(size=size, seed=seed, split="train")


def held_out_tasks(*, size: int, seed: int) -> list[dict[str, Any]]:
    """The held-out split (`python:asyncrl.data.code_tasks:held_out_tasks`)."""
    return generate(size=size, seed=seed, split="held_out")


def mbpp_item(row: dict[str, Any]) -> dict[str, Any]:
    """An item from an MBPP row (task_id, text, code, test_list, test_setup_code): the
    question is the text with the first test as the example of the call."""
    tests = list(row["test_list"])
    if not tests:
        raise ValueError(f"MBPP row {row.get('task_id')!r} has no tests")
    setup = (row.get("test_setup_code") or "").strip()
    return {
        "id": f"mbpp-{row['task_id']}",
        "question": f"{row['text']}\nYour code should pass this test:\n{tests[0]}",
        "answer": row["code"],
        "tests": [f"{setup}\n{t}" if setup else t for t in tests],
        "task": "mbpp",
    }


def mbpp_tasks(*, size: int, seed: int, split: str = "train",
               dataset: str = "google-research-datasets/mbpp",
               name: str = "full") -> list[dict[str, Any]]:
    """The first `size` MBPP problems of `split`, from the HF hub or its cache
    (`python:asyncrl.data.code_tasks:mbpp_tasks`); `seed` is unused (file order)."""
    import datasets  # only when MBPP is asked for

    rows = datasets.load_dataset(dataset, name, split=split)
    return [mbpp_item(row) for row in rows.select(range(min(size, len(rows))))]

