"""Load dataset items: local JSONL, HF datasets, or generated reasoning-gym tasks.

An item is a plain, picklable dict:
  id        unique string
  question  the prompt text (the chat prompt is built from it by the workflow)
  answer    the ground truth as a string (GSM8K: the text after "####", commas removed)
  task      the task name ("gsm8k", a reasoning-gym task, ...)
  solution  GSM8K-format rows only: the full reference solution
  metadata  reasoning-gym items only: what the task's scorer needs
  raw_answer  reasoning-gym items whose answer is not a string (None): as generated
"""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path
from typing import Any

from asyncrl.config.schema import DatasetConfig

REASONING_GYM_PREFIX = "reasoning_gym:"
PYTHON_PREFIX = "python:"  # python:package.module:function generates the items
# File names that say which split a file is, not which dataset: the task is then named
# after the folder ("gsm8k/test.jsonl" is task "gsm8k").
_SPLIT_NAMES = {"train", "test", "valid", "validation", "dev", "eval"}

logger = logging.getLogger(__name__)
MAX_REPORTED_ROWS = 5  # malformed rows named one by one in the warning; the rest counted


class DatasetError(ValueError):
    """A dataset cannot be found or one of its rows is malformed."""


def load_dataset(cfg: DatasetConfig) -> list[dict[str, Any]]:
    """The items of `cfg.path`, the first `cfg.size` of them if set."""
    path = cfg.path
    if not path:
        raise DatasetError("dataset path is empty: give a JSONL file or folder, an HF dataset "
                           "id, or reasoning_gym:<task>")
    if cfg.size is not None and cfg.size < 1:
        raise DatasetError(f"dataset size must be >= 1 or null, got {cfg.size}")
    if path.startswith(REASONING_GYM_PREFIX):
        return load_reasoning_gym(path[len(REASONING_GYM_PREFIX):], size=cfg.size or 1000,
                                  seed=cfg.seed, **cfg.task_kwargs)
    if path.startswith(PYTHON_PREFIX):
        return load_generated(path[len(PYTHON_PREFIX):], size=cfg.size or 1000, seed=cfg.seed,
                              **cfg.task_kwargs)
    local = Path(path).expanduser()
    if local.is_file():
        return load_jsonl(local, limit=cfg.size, bad_rows=cfg.bad_rows)
    if local.is_dir():
        return _load_jsonl_files(_split_files(local, cfg.split), limit=cfg.size,
                                 bad_rows=cfg.bad_rows)
    if path.startswith((".", "/", "~")) or path.endswith(".jsonl"):
        raise DatasetError(f"dataset path {path!r} does not exist")
    return load_hf(path, split=cfg.split, limit=cfg.size, **cfg.task_kwargs)


def load_datasets(cfgs: list[DatasetConfig], *, limit: int | None = None
                  ) -> list[dict[str, Any]]:
    """The items of several datasets (the first `limit` of each), in order, as one set. An
    item whose id an earlier dataset already holds is renamed "<task>/<id>" (two folders of
    `test.jsonl` rows both number them test-1, test-2, ...)."""
    items: list[dict[str, Any]] = []
    earlier: dict[str, str] = {}  # id -> the path of the dataset that holds it
    for cfg in cfgs:
        these = load_dataset(cfg)[:limit]
        for i, item in enumerate(these):
            if item["id"] in earlier:
                these[i] = item = {**item, "id": f"{item.get('task', '')}/{item['id']}"}
            if item["id"] in earlier:
                raise DatasetError(
                    f"item id {item['id']!r} of {cfg.path!r} is also an item of "
                    f"{earlier[item['id']]!r}: give the rows of one of them other ids or tasks")
        earlier |= {item["id"]: cfg.path for item in these}
        items += these
    return items


def held_out(items: list[dict[str, Any]], train_items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`items` without those that are also training items (decontamination): the same
    question, and for items with images the same images too (a templated question about
    another image is another item)."""
    seen = {_item_key(item) for item in train_items}
    kept = [item for item in items if _item_key(item) not in seen]
    if len(kept) < len(items):
        logger.info("held-out set: dropped %d of %d items that also appear in the training set",
                    len(items) - len(kept), len(items))
    if not kept:
        raise ValueError(f"all {len(items)} held-out items also appear in the training set")
    return kept


def _item_key(item: dict[str, Any]) -> tuple:
    """What makes two items the same: the question and the images (data URLs as they are,
    PIL images by their pixels)."""
    images = tuple(im if isinstance(im, str) else (im.mode, im.size, im.tobytes())
                   for im in item.get("images") or ())
    return item["question"], images


def load_generated(spec: str, *, size: int, seed: int, **kwargs: Any) -> list[dict[str, Any]]:
    """Items from a generator function `spec` ("package.module:function"), called with
    (size=, seed=, **task_kwargs); each item needs a unique "id" and a "question"."""
    import importlib

    module_name, _, fn_name = spec.rpartition(":")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError, ValueError) as e:
        raise DatasetError(f"dataset python:{spec}: cannot import it ({e}); give "
                           "python:package.module:function") from None
    items = fn(size=size, seed=seed, **kwargs)
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("id"), str) \
                or not isinstance(item.get("question"), str):
            raise DatasetError(f"dataset python:{spec}: item {i} is not a dict with a string "
                               "'id' and 'question'")
    if len({item["id"] for item in items}) != len(items):
        raise DatasetError(f"dataset python:{spec}: item ids are not unique")
    return list(items)


# -- JSONL ------------------------------------------------------------------------------


def load_jsonl(path: str | Path, *, limit: int | None = None, task: str | None = None,
               bad_rows: str = "skip") -> list[dict[str, Any]]:
    """Items from a JSONL file (gzipped when its name ends in .gz, as HumanEval ships) of
    {"question", "answer"} rows (GSM8K format accepted).

    A malformed row raises DatasetError naming the file and line with `bad_rows="error"`;
    with "skip" it is left out, and one warning counts the skipped rows and names them.
    """
    if bad_rows not in ("skip", "error"):
        raise ValueError(f"bad_rows must be 'skip' or 'error', got {bad_rows!r}")
    path = Path(path)
    task = task or _task_name(path)
    items: list[dict[str, Any]] = []
    skipped: list[str] = []
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if limit is not None and len(items) >= limit:
                break
            if not line.strip():
                continue
            try:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DatasetError(f"invalid JSON ({e.msg} at column {e.colno})") from None
                item = row_to_item(row, default_id=f"{path.stem}-{lineno}", default_task=task)
            except DatasetError as e:
                if bad_rows == "error":
                    raise DatasetError(f"{path}:{lineno}: {e}") from None
                skipped.append(f"line {lineno}: {e}")
                continue
            items.append(item)
    report_skipped(path, skipped, kept=len(items))
    return items


def report_skipped(source: str | Path, skipped: list[str], *, kept: int) -> None:
    """One warning for the malformed rows skipped from `source` (the first few named);
    an error if no row was kept."""
    if not skipped:
        return
    if not kept:
        raise DatasetError(f"{source}: all {len(skipped)} rows are malformed (first: "
                           f"{skipped[0]})")
    shown = "; ".join(skipped[:MAX_REPORTED_ROWS])
    more = f"; and {len(skipped) - MAX_REPORTED_ROWS} more" \
        if len(skipped) > MAX_REPORTED_ROWS else ""
    logger.warning("%s: skipped %d malformed row(s) (%s%s); set the dataset's "
                   "bad_rows=error to stop on them instead", source, len(skipped), shown, more)


def row_to_item(row: Any, *, default_id: str, default_task: str) -> dict[str, Any]:
    """An item from one {"question", "answer"[, "id", "task"]} row, or a HumanEval row
    {"task_id", "prompt", "canonical_solution", "test", "entry_point"} (the prompt is the
    question). Other keys of the row (a code task's "tests", ...) stay in the item."""
    if not isinstance(row, dict):
        raise DatasetError(f"expected a JSON object, got {type(row).__name__}")
    if "question" not in row and {"prompt", "test", "entry_point"} <= set(row):
        row = {**row, "id": row.get("task_id", default_id), "question": row["prompt"],
               "answer": row.get("canonical_solution", "")}
    for key in ("question", "answer"):
        if key not in row:
            raise DatasetError(f"missing key {key!r} (row has {sorted(row)})")
    question, answer = row["question"], row["answer"]
    if not isinstance(question, str) or not question.strip():
        raise DatasetError(f"'question' must be a non-empty string, got {question!r:.80}")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str):
        raise DatasetError(f"'answer' must be a string or number, got {type(answer).__name__}")
    item = {**row, "id": str(row.get("id", default_id)), "question": question,
            "answer": answer.strip(), "task": str(row.get("task", default_task))}
    if "####" in answer:  # GSM8K: a worked solution ending in "#### <answer>"
        item["solution"] = answer
        item["answer"] = answer.rsplit("####", 1)[1].strip().replace(",", "")
        if not item["answer"]:
            raise DatasetError("nothing after '####' in 'answer'")
    return item


def _task_name(path: Path) -> str:
    name = Path(path.name.removesuffix(".gz")).stem  # "HumanEval.jsonl.gz" is HumanEval
    stem = name.split("-")[0]  # "train-00000" shards
    return path.parent.name if stem in _SPLIT_NAMES and path.parent.name else name


def _split_files(folder: Path, split: str) -> list[Path]:
    """`<split>.jsonl` in `folder`, else its shards `<split>-*.jsonl`."""
    exact = folder / f"{split}.jsonl"
    if exact.is_file():
        return [exact]
    shards = sorted(folder.glob(f"{split}-*.jsonl"))
    if shards:
        return shards
    found = sorted(p.name for p in folder.glob("*.jsonl"))
    raise DatasetError(f"no {split}.jsonl (or {split}-*.jsonl) in {folder}; it holds "
                       f"{found or 'no JSONL files'}; set the dataset's split or give a file")


def _load_jsonl_files(files: list[Path], *, limit: int | None,
                      bad_rows: str = "skip") -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for f in files:
        remaining = None if limit is None else limit - len(items)
        if remaining == 0:
            break
        items.extend(load_jsonl(f, limit=remaining, bad_rows=bad_rows))
    return items


# -- HF datasets ------------------------------------------------------------------------


def load_hf(dataset_id: str, *, split: str, limit: int | None = None,
            **kwargs: Any) -> list[dict[str, Any]]:
    """Items from an HF dataset with question/answer columns (`kwargs` go to load_dataset)."""
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"dataset {dataset_id!r} is not a local file or folder; loading it "
                           "from the HF hub needs the datasets package: pip install datasets"
                           ) from None
    ds = datasets.load_dataset(dataset_id, split=split, **kwargs)
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    task = dataset_id.rstrip("/").split("/")[-1]
    items = []
    for i, row in enumerate(ds):
        try:
            items.append(row_to_item(row, default_id=f"{task}-{split}-{i}", default_task=task))
        except DatasetError as e:
            raise DatasetError(f"{dataset_id} [{split}] row {i}: {e}") from None
    return items


# -- reasoning-gym ----------------------------------------------------------------------


def load_reasoning_gym(task: str, *, size: int, seed: int,
                       **task_kwargs: Any) -> list[dict[str, Any]]:
    """`size` generated `task` items; the same seed and options give the same items.

    reasoning-gym builds item i from Random(seed + i), so seeds s and s + 1 give the same
    items shifted by one: keep train and validation seeds more than `size` apart.
    """
    import reasoning_gym  # slow to import: only when a reasoning-gym task is asked for

    try:
        ds = reasoning_gym.create_dataset(task, size=size, seed=seed, **task_kwargs)
    except (ValueError, TypeError, AssertionError) as e:  # task configs validate by assert
        raise DatasetError(f"reasoning_gym:{task} with {task_kwargs}: {e}") from e
    return [_rg_item(entry, item_id=f"{task}-s{seed}-{i}", task=task) for i, entry in enumerate(ds)]


def _rg_item(entry: dict[str, Any], *, item_id: str, task: str) -> dict[str, Any]:
    answer = entry["answer"]
    as_text = answer if isinstance(answer, str) else ("" if answer is None else str(answer))
    item = {"id": item_id, "question": entry["question"], "answer": as_text,
            "task": task, "metadata": entry["metadata"]}
    if not isinstance(answer, str):
        # A few tasks (graph_color, rush_hour, ...) have no single answer and score from the
        # metadata; their scorer gets the entry exactly as generated.
        item["raw_answer"] = answer
    return item
