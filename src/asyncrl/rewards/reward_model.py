"""A trained reward model as an RL reward function (`workflow.reward_fn: reward_model`).

It scores [user: item["question"], assistant: completion] rendered by the reward model's
chat template (what `asyncrl rm` trains on for string prompts), after a system turn if the
model was trained with `system_prompt` (saved in its config), with no gradient, on the
CPU. The reward runner calls it in worker processes: the model is loaded when a worker
unpickles the scorer, so loading counts against the worker's start-up time and not
against `workflow.reward_timeout`. Every failure raises; nothing is scored 0.
"""

from __future__ import annotations

import multiprocessing
import threading
from typing import Any

import torch

from asyncrl.models.hub import resolve_model_path
from asyncrl.models.reward import encode_conversation, last_token_scores, load_reward_model


class RewardModelScorer:
    """`scorer(completion, item) -> float`; `score_batch` scores many in one forward."""

    def __init__(self, path: str, *, threads: int = 1) -> None:
        from transformers import AutoConfig

        self.path = resolve_model_path(path)
        self.threads = threads
        num_labels = AutoConfig.from_pretrained(self.path).num_labels
        if num_labels != 1:
            raise ValueError(f"workflow.reward_model_path={path!r} has num_labels={num_labels}; "
                             "give a reward model trained by `asyncrl rm` (one label)")
        self._lock = threading.Lock()
        self._model: torch.nn.Module | None = None
        self._tokenizer: Any = None
        self._system_prompt: str | None = None

    def __repr__(self) -> str:  # names the function in reward errors
        return f"reward_model({self.path})"

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "threads": self.threads}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path, self.threads = state["path"], state["threads"]
        self._lock, self._model, self._tokenizer = threading.Lock(), None, None
        self._system_prompt = None
        if multiprocessing.parent_process() is not None:
            # Unpickled in a reward worker process: its own threads, and the model loaded now.
            torch.set_num_threads(self.threads)
            self._load()

    def _load(self) -> tuple[torch.nn.Module, Any]:
        from transformers import AutoTokenizer

        with self._lock:
            if self._model is None:
                self._tokenizer = AutoTokenizer.from_pretrained(self.path)
                self._model = load_reward_model(self.path).eval()
                # The system turn `asyncrl rm` rendered its rows with (see FSDPRewardEngine).
                self._system_prompt = getattr(self._model.config, "system_prompt", None)
        return self._model, self._tokenizer

    def __call__(self, completion: str, item: dict[str, Any]) -> float:
        return self.score_batch([(completion, item)])[0]

    @torch.no_grad()
    def score_batch(self, samples: list[tuple[str, dict[str, Any]]]) -> list[float]:
        """Rewards of (completion, item) samples, right-padded into one forward."""
        model, tokenizer = self._load()
        rows = [encode_conversation(tokenizer, _conversation(c, item, self._system_prompt))
                for c, item in samples]
        width = max(map(len, rows))
        input_ids = torch.full((len(rows), width), tokenizer.pad_token_id or 0)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, ids in enumerate(rows):
            input_ids[i, :len(ids)], mask[i, :len(ids)] = torch.tensor(ids), 1
        return last_token_scores(model, input_ids, mask).tolist()


def _conversation(completion: str, item: dict[str, Any],
                  system_prompt: str | None) -> list[dict[str, str]]:
    """The messages of a training row {"prompt": question, "chosen": completion}."""
    if not isinstance(item.get("question"), str):
        raise ValueError(f"item {item.get('id', '?')!r} has no 'question' string for the "
                         "reward model to score the completion against")
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return system + [{"role": "user", "content": item["question"]},
                     {"role": "assistant", "content": completion}]
