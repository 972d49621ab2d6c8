"""Rows for offline training (SFT, DPO, RM): JSONL parsed, rendered by the chat template, tokenised.

An example is the rows that train together: one row for SFT, (chosen, rejected) for DPO
and reward models. A row's loss mask marks the tokens its loss reads: for SFT and DPO the
assistant turns being learned, end-of-turn tokens included (so the model learns to stop);
for a reward model the last token, where its score is read (`last_token_row`).

Row shapes (`OfflineDatasetConfig.format`):
  prompt_answer  {"prompt", "answer" | "completion"}
  chat           {"messages": [{"role", "content"}, ...]}: every assistant turn is learned
  gsm8k          {"question", "answer"}: the answer is the worked solution, learned whole
  preference     {"prompt", "chosen", "rejected"}, or {"chosen", "rejected"} as whole
                 conversations (TRL's implicit prompt: their common first messages)
A prompt is a string (one user turn, after `system_prompt` if set) or a list of chat
messages; an answer, chosen or rejected is a string (one assistant turn) or a list of
messages that continue the prompt.

An SFT row may hold "images" (PNG/JPEG data URLs, or image files' paths from the working
directory) for a vision-language model: as in RLVR prompts they go first in the first
user turn, and the model's processor expands each into its image tokens and makes the
pixel tensors the row trains with.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncrl.api.types import ImageInputs, TensorBatch, image_fields
from asyncrl.config.offline import OfflineDatasetConfig
from asyncrl.data.loading import DatasetError, _split_files, report_skipped
from asyncrl.data.prompts import build_messages, encode_chat
from asyncrl.models.processors import image_text
from asyncrl.models.reward import encode_conversation

ROLES = ("system", "user", "assistant", "tool")
SFT_SHAPES = "{prompt, answer|completion}, {messages} or {question, answer}"

logger = logging.getLogger(__name__)


@dataclass
class TokenRow:
    """One tokenised sequence and the tokens its loss reads."""

    input_ids: list[int]
    loss_mask: list[int]
    label: float = 0.0  # preference pairs: 1 on the chosen row, 0 on the rejected one
    ref_logprobs: torch.Tensor | None = None  # [len(input_ids)]: the reference model's
    images: ImageInputs | None = None  # the tiles the row's image tokens stand for


Example = list[TokenRow]
Messages = list[dict[str, str]]
# (tokenizer, messages, index of the first learned message) -> a row with its loss mask.
RowFn = Callable[[Any, Messages, int], TokenRow]


# -- reading ----------------------------------------------------------------------------


def dataset_files(cfg: OfflineDatasetConfig) -> list[Path]:
    """The JSONL file `cfg.path`, or the `<split>` file(s) of the folder `cfg.path`."""
    path = Path(cfg.path).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        return _split_files(path, cfg.split)
    raise DatasetError(f"dataset path {cfg.path!r} does not exist (give a JSONL file or a "
                       f"folder holding {cfg.split}.jsonl)")


def read_jsonl(files: list[Path], limit: int | None = None,
               skipped: list[str] | None = None) -> Iterator[tuple[str, dict]]:
    """("file:line", row) for the first `limit` JSON-object rows of `files`. A line that is
    not one raises DatasetError naming file and line, or, given a `skipped` list, is
    recorded there ("file:line: why") and left out."""
    count = 0
    for path in files:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if limit is not None and count >= limit:
                    return
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    row = json.loads(line)
                    why = None if isinstance(row, dict) else \
                        f"expected a JSON object, got {type(row).__name__}"
                except json.JSONDecodeError as e:
                    why = f"invalid JSON ({e.msg} at column {e.colno})"
                if why is not None:
                    if skipped is None:
                        raise DatasetError(f"{where}: {why}")
                    skipped.append(f"{where}: {why}")
                    continue
                count += 1
                yield where, row


# -- row shapes -> chat messages --------------------------------------------------------


def _text(row: dict, key: str) -> str:
    value = row.get(key)
    if not isinstance(value, str) or not value.strip():
        raise DatasetError(f"{key!r} must be a non-empty string, got {value!r:.80}")
    return value


def check_messages(value: Any, key: str) -> Messages:
    """`value` as chat messages: a non-empty list of {"role", "content": str}."""
    if not isinstance(value, list) or not value:
        raise DatasetError(f"{key!r} must be a string or a non-empty list of chat messages, "
                           f"got {value!r:.80}")
    for i, msg in enumerate(value):
        if not isinstance(msg, dict) or not isinstance(msg.get("content"), str):
            raise DatasetError(f"{key}[{i}] must be {{'role': ..., 'content': str}}, got "
                               f"{msg!r:.80}")
        if msg.get("role") not in ROLES:
            raise DatasetError(f"{key}[{i}] has role {msg.get('role')!r}; use one of {ROLES}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _prompt(row: dict, key: str, system_prompt: str | None) -> Messages:
    if isinstance(row.get(key), list):
        return check_messages(row[key], key)
    return build_messages(_text(row, key), system_prompt=system_prompt)


def _reply(row: dict, key: str) -> Messages:
    """The assistant reply under `key`: a string, or messages with an assistant turn."""
    if isinstance(row.get(key), list):
        messages = check_messages(row[key], key)
        if not any(m["role"] == "assistant" for m in messages):
            raise DatasetError(f"{key!r} has no assistant message to learn")
        return messages
    return [{"role": "assistant", "content": _text(row, key)}]


def _sft_format(row: dict) -> str:
    """The SFT row shape, from the row's keys."""
    if "messages" in row:
        return "chat"
    if "chosen" in row or "rejected" in row:
        raise DatasetError("a preference row (chosen/rejected) in an SFT dataset; train it "
                           "with `asyncrl dpo` or `asyncrl rm`")
    if "prompt" in row:
        return "prompt_answer"
    if "question" in row:
        return "gsm8k"
    raise DatasetError(f"cannot tell the row's format from its keys {sorted(row)}; SFT rows "
                       f"are {SFT_SHAPES}")


def sft_conversation(row: dict, fmt: str, system_prompt: str | None) -> tuple[Messages, int]:
    """An SFT row's messages and the index of the first one whose assistant turns are learned."""
    fmt = _sft_format(row) if fmt == "auto" else fmt
    if fmt == "chat":
        messages = check_messages(row.get("messages"), "messages")
        if not any(m["role"] == "assistant" for m in messages):
            raise DatasetError("'messages' has no assistant turn to learn")
        return messages, 0
    if fmt == "gsm8k":
        prompt = build_messages(_text(row, "question"), system_prompt=system_prompt)
        return prompt + [{"role": "assistant", "content": _text(row, "answer")}], len(prompt)
    if fmt != "prompt_answer":
        raise DatasetError(f"format {fmt!r} is not an SFT format ({SFT_SHAPES})")
    key = "answer" if "answer" in row else "completion"
    if key not in row:
        raise DatasetError(f"missing key 'answer' (or 'completion'); the row has {sorted(row)}")
    prompt = _prompt(row, "prompt", system_prompt)
    return prompt + _reply(row, key), len(prompt)


def preference_conversations(row: dict,
                             system_prompt: str | None) -> tuple[Messages, Messages, int]:
    """(chosen, rejected) conversations of a preference row, and how many messages they share.

    With a prompt, chosen and rejected continue it. Without one they are whole conversations
    (TRL's implicit-prompt form) and the prompt is their longest common first messages.
    """
    missing = [k for k in ("chosen", "rejected") if k not in row]
    if missing:
        raise DatasetError(f"missing {missing}: preference rows are {{prompt, chosen, "
                           f"rejected}} (or chosen and rejected as whole conversations); the "
                           f"row has {sorted(row)}")
    if "prompt" in row:
        prompt = _prompt(row, "prompt", system_prompt)
        chosen, rejected = prompt + _reply(row, "chosen"), prompt + _reply(row, "rejected")
        shared = len(prompt)
    else:
        chosen, rejected, shared = _implicit_prompt_pair(row)
    if chosen == rejected:
        raise DatasetError("'chosen' and 'rejected' are identical: the pair carries no "
                           "preference")
    return chosen, rejected, shared


def _implicit_prompt_pair(row: dict) -> tuple[Messages, Messages, int]:
    """Whole-conversation chosen and rejected, and the length of their common prefix."""
    if not (isinstance(row["chosen"], list) and isinstance(row["rejected"], list)):
        raise DatasetError("no 'prompt': chosen and rejected must then be whole conversations "
                           "(message lists); or add the prompt")
    chosen = check_messages(row["chosen"], "chosen")
    rejected = check_messages(row["rejected"], "rejected")
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    for key, messages in (("chosen", chosen), ("rejected", rejected)):
        if not any(m["role"] == "assistant" for m in messages[shared:]):
            raise DatasetError(f"{key!r} has no assistant message after the {shared} messages "
                               "it shares with the other side (the implicit prompt)")
    return chosen, rejected, shared


# -- tokenising -------------------------------------------------------------------------


# (messages, add_generation_prompt) -> their token ids
Encode = Callable[[Messages, bool], list[int]]


def _prefix_len(encode: Encode, messages: Messages, full: list[int], *, generation: bool,
                upto: int) -> int:
    """Tokens of `messages` rendered alone, checked to be the start of `full`."""
    ids = encode(messages, generation)
    if full[:len(ids)] != ids:
        raise DatasetError(f"the chat template renders the first {upto} messages differently "
                           "alone than inside the whole conversation (it rewrites earlier "
                           "turns), so the learned turns cannot be located in the tokens")
    return len(ids)


def tokenize_conversation(tokenizer: Any, messages: Messages, loss_from: int = 0) -> TokenRow:
    """Chat-template tokens of `messages`, loss on the assistant turns from `loss_from` on."""
    def encode(msgs: Messages, generation: bool) -> list[int]:
        return encode_chat(tokenizer, msgs, add_generation_prompt=generation)
    ids = encode(messages, False)
    return TokenRow(input_ids=ids, loss_mask=_loss_mask(encode, messages, ids, loss_from))


def _loss_mask(encode: Encode, messages: Messages, ids: list[int], loss_from: int) -> list[int]:
    """1 on the tokens `ids` of `messages` that are assistant turns from `loss_from` on."""
    mask = [0] * len(ids)
    for i in range(loss_from, len(messages)):
        if messages[i]["role"] != "assistant":
            continue
        # The turn spans from the end of "everything before + generation prompt" to the end
        # of "everything up to this turn" (its end-of-turn tokens included).
        start = _prefix_len(encode, messages[:i], ids, generation=True, upto=i)
        end = len(ids) if i == len(messages) - 1 else _prefix_len(
            encode, messages[:i + 1], ids, generation=False, upto=i + 1)
        mask[start:end] = [1] * (end - start)
    if not any(mask):
        raise DatasetError("no assistant tokens to learn after the prompt")
    return mask


def tokenize_image_conversation(processor: Any, messages: Messages, images: list[Any],
                                loss_from: int = 0) -> TokenRow:
    """`tokenize_conversation` for a vision-language model: `images` (PIL) go first in the
    first user turn, and `processor` (the model's, e.g. Idefics3's) expands each into its
    image tokens; the row carries their tiles."""
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None or first_user >= loss_from:
        raise DatasetError("a row with images needs a user turn before the learned turns "
                           "to hold them")
    placeholder = processor.image_token
    messages = [dict(m) for m in messages]
    messages[first_user]["content"] = image_text(processor) * len(images) + \
        messages[first_user]["content"]
    found = sum(m["content"].count(placeholder) for m in messages)
    if found != len(images):
        raise DatasetError(f"the messages hold {found - len(images)} image placeholders "
                           f"{placeholder!r} of their own: remove them from the text (the "
                           "row's images are placed for it)")

    def features(msgs: Messages, generation: bool) -> Any:
        text = processor.tokenizer.apply_chat_template(msgs, tokenize=False,
                                                       add_generation_prompt=generation)
        return processor(text=text, images=images, add_special_tokens=False,
                         return_tensors="pt")

    def encode(msgs: Messages, generation: bool) -> list[int]:
        return features(msgs, generation)["input_ids"][0].tolist()

    full = features(messages, False)
    ids = full["input_ids"][0].tolist()
    return TokenRow(input_ids=ids, loss_mask=_loss_mask(encode, messages, ids, loss_from),
                    images=ImageInputs.from_processor(full))


_DATA_URL = re.compile(r"data:image/[A-Za-z0-9.+-]+;base64,(.*)", re.DOTALL)


def load_image(value: Any, where: str) -> Any:
    """The RGB PIL image of a data URL or an image file; DatasetError naming `where` else."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(value, str):
        raise DatasetError(f"{where} must be a string: a data URL (data:image/png;base64,...) "
                           f"or an image file's path, got {type(value).__name__}")
    match = _DATA_URL.fullmatch(value)
    try:
        source = io.BytesIO(base64.b64decode(match.group(1), validate=True)) if match \
            else Path(value).expanduser()
        image = Image.open(source)
        image.load()
    except binascii.Error as e:
        raise DatasetError(f"{where}: the data URL is not valid base64 ({e})") from None
    except FileNotFoundError:
        raise DatasetError(f"{where}: {value!r:.80} is neither a data URL "
                           "(data:image/png;base64,...) nor an existing image file") from None
    except (UnidentifiedImageError, OSError) as e:
        raise DatasetError(f"{where} holds no image Pillow can read: {e}") from None
    return image.convert("RGB")


def last_token_row(tokenizer: Any, messages: Messages, loss_from: int = 0) -> TokenRow:
    """Tokens of the whole conversation as a reward model scores it; loss on the last token.

    The tokens are `encode_conversation`'s, the rendering RL scoring uses (so a trained
    reward model sees completions as it saw training rows); `loss_from` plays no part.
    """
    ids = encode_conversation(tokenizer, messages)
    return TokenRow(input_ids=ids, loss_mask=[0] * (len(ids) - 1) + [1])


# -- datasets ---------------------------------------------------------------------------


def _load(cfg: OfflineDatasetConfig, parse: Callable[[dict], Example]) -> list[Example]:
    """Examples of every row of `cfg`'s files, long ones dropped. Malformed rows are
    skipped and reported (`bad_rows: skip`), or stop the load naming file and line."""
    examples: list[Example] = []
    skipped: list[str] | None = [] if cfg.bad_rows == "skip" else None
    for where, row in read_jsonl(dataset_files(cfg), cfg.size, skipped):
        try:
            examples.append(parse(row))
        except ValueError as e:  # DatasetError, and a chat template's own complaints
            if skipped is None:
                raise DatasetError(f"{where}: {e}") from None
            skipped.append(f"{where}: {e}")
    report_skipped(cfg.path, skipped or [], kept=len(examples))
    if not examples:
        raise DatasetError(f"dataset {cfg.path!r} has no rows")
    return _drop_long(examples, cfg.max_length, cfg.path)


def _drop_long(examples: list[Example], max_length: int | None, path: str) -> list[Example]:
    if max_length is None:
        return examples
    kept = [ex for ex in examples if max(len(r.input_ids) for r in ex) <= max_length]
    if not kept:
        raise DatasetError(f"all {len(examples)} examples of {path!r} are longer than "
                           f"max_length={max_length} tokens; raise max_length")
    if len(kept) < len(examples):
        logger.info("%s: dropped %d of %d examples longer than %d tokens", path,
                    len(examples) - len(kept), len(examples), max_length)
    return kept


def load_sft_examples(cfg: OfflineDatasetConfig, tokenizer: Any,
                      system_prompt: str | None = None, *,
                      processor: Any = None) -> list[Example]:
    """One-row examples of an SFT dataset (loss on the answer / assistant tokens).
    `processor`: a vision-language model's, for rows with "images"."""
    def parse(row: dict) -> Example:
        messages, loss_from = sft_conversation(row, cfg.format, system_prompt)
        if row.get("images") is None:
            return [tokenize_conversation(tokenizer, messages, loss_from)]
        if processor is None:
            raise DatasetError("the row has 'images' but the model reads text only (its folder "
                               "has no image processor); train a vision-language model or "
                               "drop the rows' images")
        if not isinstance(row["images"], list) or not row["images"]:
            raise DatasetError(f"'images' must be a non-empty list, got {row['images']!r:.80}")
        images = [load_image(v, f"images[{i}]") for i, v in enumerate(row["images"])]
        return [tokenize_image_conversation(processor, messages, images, loss_from)]
    return _load(cfg, parse)


def load_preference_examples(cfg: OfflineDatasetConfig, tokenizer: Any,
                             system_prompt: str | None = None, *,
                             to_row: RowFn = tokenize_conversation) -> list[Example]:
    """(chosen, rejected) examples of a preference dataset; labels 1 and 0.

    `to_row` sets what the loss reads: the answer tokens (DPO, the default) or the last
    token (`last_token_row`, reward models).
    """
    def parse(row: dict) -> Example:
        chosen, rejected, loss_from = preference_conversations(row, system_prompt)
        pair = [to_row(tokenizer, m, loss_from) for m in (chosen, rejected)]
        pair[0].label = 1.0
        return pair
    return _load(cfg, parse)


def collate(rows: list[TokenRow], pad_token_id: int) -> TensorBatch:
    """Right-padded tensors of `rows`; `rewards` holds the labels, `ref_logprobs` if known,
    and the image fields the rows' tiles."""
    if not rows:
        raise ValueError("cannot collate an empty list of rows")
    n, width = len(rows), max(len(r.input_ids) for r in rows)
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.bool)
    loss_mask = torch.zeros((n, width), dtype=torch.float32)
    for i, r in enumerate(rows):
        input_ids[i, :len(r.input_ids)] = torch.tensor(r.input_ids)
        attention_mask[i, :len(r.input_ids)] = True
        loss_mask[i, :len(r.loss_mask)] = torch.tensor(r.loss_mask, dtype=torch.float32)
    with_ref = sum(r.ref_logprobs is not None for r in rows)
    if with_ref not in (0, n):
        raise ValueError(f"{n - with_ref} of {n} rows lack reference log-probs")
    ref = None
    if with_ref:
        ref = torch.zeros((n, width), dtype=torch.float32)
        for i, r in enumerate(rows):
            ref[i, :len(r.ref_logprobs)] = r.ref_logprobs
    return TensorBatch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask,
                       behavior_logprobs=torch.zeros((n, width)),
                       versions=torch.full((n, width), -1, dtype=torch.long),
                       rewards=torch.tensor([r.label for r in rows], dtype=torch.float32),
                       ref_logprobs=ref, **image_fields([r.images for r in rows]))
