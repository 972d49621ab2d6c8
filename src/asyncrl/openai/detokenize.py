"""Token ids to text, one token at a time, for streamed and non-streamed OpenAI answers.

Both paths run the same `IncrementalDetokenizer`, so the concatenated stream equals the
non-streamed text by construction. It never emits part of a UTF-8 character (a byte-level
token can hold half of one) and never emits text that may turn out to start a stop string.
Special tokens decode to nothing, except those named in `keep` (tool-call markers such as
`<|python_tag|>`, which the tool-call parser must see).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Collection

_REPLACEMENT = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence
_SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback pieces


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: printable stand-in character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The raw bytes of one token (special tokens as their text), as OpenAI's `bytes` field."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if piece is None:  # a padding row of the model's vocabulary: sampleable, but no text
        return b""
    if token_id in tokenizer.all_special_ids:
        return piece.encode()
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    table = _byte_decoder()
    if type(decoder).__name__ == "ByteLevel" and all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    match = _SP_BYTE.fullmatch(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    if "\u2581" in piece:  # SentencePiece marks a space with U+2581
        return piece.replace("\u2581", " ").encode()
    return tokenizer.decode([token_id]).encode()


def token_string(raw: bytes) -> str:
    """A token's text; partial UTF-8 is shown as `bytes:\\xNN..` the way OpenAI shows it."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class IncrementalDetokenizer:
    """Turns completion tokens into text deltas; stops the text at the first stop string.

    Each step decodes a short window (the previous token for context, then the new ones),
    as vLLM does, so the cost per token stays constant and SentencePiece spaces come out
    right. Special tokens (EOS) decode to nothing, except the ids in `keep`: their text stays.
    """

    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = (),
                 keep: Collection[int] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.keep = frozenset(keep)
        self.ids: list[int] = []
        self.stopped = False  # a stop string was found; later tokens add no text
        self._prefix = 0  # window start: ids before it are already text
        self._read = 0  # ids before it have been turned into text
        self._pending = ""  # decoded text held back: it may begin a stop string
        self.emitted = 0  # characters of text emitted so far

    def push(self, token_id: int) -> str:
        """Add one token; the text that is now safe to emit (often '')."""
        self.ids.append(token_id)
        if self.stopped:
            return ""
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        new_text = self._decode(self.ids[self._prefix:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""  # an incomplete character: wait for its next byte
        self._prefix, self._read = self._read, len(self.ids)
        return self._release(new_text[len(prefix_text):], final=False)

    def finish(self) -> str:
        """The text still held back once generation has ended."""
        if self.stopped:
            return ""
        tail = self._decode(self.ids[self._prefix:])[len(self._decode(
            self.ids[self._prefix:self._read])):]
        self._read = len(self.ids)
        return self._release(tail, final=True)

    def _decode(self, ids: list[int]) -> str:
        if not self.keep.intersection(ids):
            return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
        # Decode around each kept token, so other special tokens are still skipped the
        # tokenizer's own way (its `special` flag, which `all_special_ids` does not cover).
        parts, start = [], 0
        for i, t in enumerate(ids):
            if t in self.keep:
                parts += [self._decode(ids[start:i]), self.tokenizer.convert_ids_to_tokens(t)]
                start = i + 1
        parts.append(self._decode(ids[start:]))
        return "".join(parts)

    def _release(self, delta: str, *, final: bool) -> str:
        text = self._pending + delta
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            out, self._pending = text[:min(hits)], ""
        elif final:
            out, self._pending = text, ""
        else:
            keep = _stop_prefix_len(text, self.stop)
            out, self._pending = text[:len(text) - keep], text[len(text) - keep:]
        self.emitted += len(out)
        return out


def _stop_prefix_len(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def detokenize(tokenizer, ids: list[int], stop: list[str] | tuple[str, ...] = (),
               keep: Collection[int] = ()) -> tuple[str, list[int]]:
    """The text of `ids` cut at the first stop string, and each token's offset into it."""
    detok = IncrementalDetokenizer(tokenizer, stop, keep)
    parts, offsets = [], []
    for tok in ids:
        offsets.append(detok.emitted)
        parts.append(detok.push(tok))
    parts.append(detok.finish())
    return "".join(parts), offsets
