"""The quickstart task: two-number addition from reasoning-gym, sized for SmolLM2-135M.

Chosen so that SmolLM2-135M-Instruct starts in the middle of the reward range, where GRPO
has signal (groups with both right and wrong answers). Measured with HF transformers, bf16,
on the CPU, max_new_tokens=32, scored by `reasoning_gym_reward`:

    greedy:            38.5% (64 prompts, seed 1)   38.0% (128 prompts, seed 2)
    temperature 1.0:   21.9% (64 prompts, seed 1)   17.2% (128 prompts, seed 2)

Without the "a + b = c." step in the example the model answers directly and gets ~6% greedy
(~2% at temperature 1.0); chain_sum (with subtraction) gets ~3%. Completions average ~21
tokens; at temperature 1.0 about 1 in 6 rambles past 32 tokens without an answer.

reasoning-gym builds item i of seed s from Random(s + i): seeds s and s + 1 give the same
items shifted by one. Train and validation seeds must be further apart than the dataset size.
"""

from __future__ import annotations

from typing import Any

QUICKSTART_TASK_KWARGS: dict[str, Any] = {
    "min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2,
    "operators": ["+"], "allow_parentheses": False, "allow_negation": False,
}

QUICKSTART_SYSTEM_PROMPT = "Give the final answer inside <answer></answer> tags."

# The worked step before the answer is what lifts accuracy from ~6% to ~38%.
QUICKSTART_FEW_SHOT: list[dict[str, str]] = [
    {"question": "Calculate 23 + 45.", "answer": "23 + 45 = 68. <answer>68</answer>"},
]

# Config sections as the YAML loader reads them (merge into the quickstart config).
QUICKSTART: dict[str, Any] = {
    "train_dataset": {"path": "reasoning_gym:basic_arithmetic", "size": 2000, "seed": 0,
                      "task_kwargs": QUICKSTART_TASK_KWARGS},
    "valid_dataset": {"path": "reasoning_gym:basic_arithmetic", "size": 64, "seed": 1_000_000,
                      "shuffle": False, "task_kwargs": QUICKSTART_TASK_KWARGS},
    "workflow": {"reward_fn": "reasoning_gym", "system_prompt": QUICKSTART_SYSTEM_PROMPT,
                 "few_shot": QUICKSTART_FEW_SHOT},
    "gconfig": {"max_new_tokens": 32, "temperature": 1.0},
}
