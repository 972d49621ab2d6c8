"""Batched token sampling with per-row parameters, and the stop checks of one sequence.

The log-prob recorded for a sampled token is log_softmax(logits / T)[token], taken BEFORE
top-k/top-p truncation (greedy rows: log_softmax(logits)). The trainer recomputes
log-probs with the same temperature and no truncation, so the two agree on-policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from asyncrl.api.types import SamplingParams
from asyncrl.inference.server.cpu_decode import DecodeKernels


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as tensors, and flags that let `sample` skip work."""

    temperature: torch.Tensor  # [B] float32; 1.0 on greedy rows so the division is harmless
    greedy: torch.Tensor  # [B] bool
    top_p: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] long, 0 disables
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool
    seeds: torch.Tensor  # [B] long; the row's request seed (0 where it has none)
    seeded: torch.Tensor  # [B] bool
    any_seeded: bool

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams],
                    device: str | torch.device = "cpu") -> SamplingBatch:
        """Stack the parameters of the rows, in order."""
        greedy = [p.greedy for p in params]
        return cls(
            temperature=torch.tensor([1.0 if p.greedy else p.temperature for p in params],
                                     dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            any_top_k=any(p.top_k > 0 and not p.greedy for p in params),
            any_top_p=any(p.top_p < 1.0 and not p.greedy for p in params),
            seeds=torch.tensor([p.seed or 0 for p in params], dtype=torch.long, device=device),
            seeded=torch.tensor([p.seed is not None for p in params], dtype=torch.bool,
                                device=device),
            any_seeded=any(p.seed is not None and not p.greedy for p in params),
        )


_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), in int64 without overflow."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with good avalanche (C. Wellons' "lowbias32")."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seeded_uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """The uniform number in [0, 1) of draw `counters` of the streams `seeds` (both [B] long,
    seeds in [0, 2**63)): a pure function of the pair, so a request samples the same tokens
    whatever it is batched with (counter-based, as Philox is)."""
    h = _mix32((((seeds >> 32) & 0x7FFFFFFF) + _GOLDEN) & _M32)
    h = _mix32(((h ^ (seeds & _M32)) + _GOLDEN) & _M32)
    h = _mix32(((h ^ (counters & _M32)) + _GOLDEN) & _M32)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def draw_uniform(sb: SamplingBatch, generator: torch.Generator | None,
                 counters: torch.Tensor | None, device: torch.device | str = "cpu") -> torch.Tensor:
    """One uniform number per row [B]: from the row's own stream where its request has a
    seed (draw number `counters[row]`, its tokens sampled so far), else from `generator`."""
    b = sb.temperature.shape[0]
    if sb.all_greedy:
        return torch.zeros(b, device=device)
    u = torch.rand(b, generator=generator, device=device)
    if sb.any_seeded:
        if counters is None:
            raise ValueError("seeded rows need their draw counters")
        u = torch.where(sb.seeded, seeded_uniform(sb.seeds, counters.to(sb.seeds.device)), u)
    return u


def truncate(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
             use_top_k: bool, use_top_p: bool) -> torch.Tensor:
    """Set logits outside each row's top-k, then outside its top-p nucleus, to -inf.

    Top-p keeps the smallest set of most likely tokens whose mass reaches top_p, measured
    after top-k (as HF and vLLM do); the most likely token is always kept. A full sort of
    the vocabulary is slow on CPU, so candidates come from `topk`, widened only while
    some row's nucleus may extend past them.
    """
    vocab = scaled.shape[-1]
    has_k = top_k > 0
    k = min(vocab, max(256 if use_top_p else 1, int(top_k.max()) if use_top_k else 0))
    while True:
        vals, idx = scaled.topk(k, dim=-1)  # sorted, most likely first
        if use_top_k:
            rank = torch.arange(k, device=scaled.device)
            outside = (rank[None, :] >= top_k[:, None]) & has_k[:, None]
            vals = vals.masked_fill(outside, float("-inf"))
        if not use_top_p:
            break
        # Normalise over the top-k set where there is one, else over the whole vocabulary.
        log_norm = torch.where(has_k, vals.logsumexp(-1), scaled.logsumexp(-1))
        probs = (vals - log_norm[:, None]).exp()
        cum = probs.cumsum(dim=-1)
        if k == vocab or bool(((cum[:, -1] >= top_p) | has_k | (top_p >= 1.0)).all()):
            cut = (cum - probs >= top_p[:, None]) & (top_p[:, None] < 1.0)
            vals = vals.masked_fill(cut, float("-inf"))
            break
        k = min(vocab, k * 8)
    return torch.full_like(scaled, float("-inf")).scatter_(-1, idx, vals)


def _first_above(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first index with cdf > u, never past the last entry that adds mass.

    The cap matters when u rounds up to the total: the draw must not land on a trailing
    entry of zero mass.
    """
    idx = torch.searchsorted(cdf, u, right=True)
    last = torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False)
    return torch.minimum(idx, last)


def sample_from(weights: torch.Tensor, generator: torch.Generator | None = None,
                block: int = 256, u: torch.Tensor | None = None) -> torch.Tensor:
    """One draw per row of unnormalised `weights` [B, V] (>= 0); entries of 0 are never drawn.

    Inverts the CDF in two levels (which block, then where in it), so the only passes
    over the vocabulary are one block sum; torch.multinomial instead draws a random
    number per entry (~30 ms for 32 x 49k on one core). `u` [B]: the rows' uniform numbers
    (default: drawn from `generator`).
    """
    b, v = weights.shape
    n_blocks = -(-v // block)
    if n_blocks * block != v:
        weights = F.pad(weights, (0, n_blocks * block - v))
    blocks = weights.view(b, n_blocks, block)
    cdf = blocks.sum(dim=-1).cumsum(dim=-1)
    if u is None:
        u = torch.rand((b, 1), generator=generator, device=weights.device)
    u = u.reshape(b, 1).to(cdf.dtype) * cdf[:, -1:]
    blk = _first_above(cdf, u)
    before = torch.where(blk > 0, cdf.gather(-1, (blk - 1).clamp_min(0)), 0.0)
    inner = blocks[torch.arange(b, device=weights.device), blk[:, 0]].cumsum(dim=-1)
    return (blk * block + _first_above(inner, (u - before).contiguous()))[:, 0]


def sample(logits: torch.Tensor, sb: SamplingBatch, generator: torch.Generator | None = None,
           counters: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits` [B, V]; returns (tokens [B], logprobs [B] float32).

    `counters` [B]: tokens each row's request sampled so far (its draw number), needed when
    some request has a seed (`draw_uniform`).

    bf16 logits on CPU without top-k/top-p run in one C call (kernels/decode.c
    sample_rows_bf16: the same draw from the same uniform numbers, ~20x faster at B = 32).
    """
    if (logits.dtype == torch.bfloat16 and logits.device.type == "cpu"
            and not (sb.any_top_k or sb.any_top_p)):
        kernels = DecodeKernels.load()
        if kernels is not None:
            return _sample_with_kernel(kernels, logits, sb,
                                       draw_uniform(sb, generator, counters))
    logits = logits.float()
    if sb.all_greedy:
        tokens = logits.argmax(dim=-1)
        return tokens, logits.log_softmax(dim=-1).gather(-1, tokens[:, None])[:, 0]
    scaled = logits / sb.temperature[:, None]
    shifted = scaled - scaled.amax(dim=-1, keepdim=True)  # <= 0, so exp cannot overflow
    weights = shifted.exp()
    log_norm = weights.sum(dim=-1, keepdim=True).log()  # log-probs are shifted - log_norm
    if sb.any_top_k or sb.any_top_p:
        weights = truncate(shifted, sb.top_k, sb.top_p, sb.any_top_k, sb.any_top_p).exp()
    tokens = sample_from(weights, u=draw_uniform(sb, generator, counters, logits.device))
    if sb.any_greedy:
        tokens = torch.where(sb.greedy, logits.argmax(dim=-1), tokens)
    return tokens, (shifted.gather(-1, tokens[:, None]) - log_norm)[:, 0]


def top_logprobs(logits: torch.Tensor, sb: SamplingBatch,
                 ks: Sequence[int]) -> list[dict[int, float] | None]:
    """Per row, its `ks[row]` most likely tokens {id: log-prob} under the distribution the
    sampled token's log-prob comes from (log_softmax(logits / T), greedy rows T = 1); None
    for rows with k = 0."""
    out: list[dict[int, float] | None] = [None] * len(ks)
    rows = [i for i, k in enumerate(ks) if k > 0]
    if not rows:
        return out
    index = torch.tensor(rows, device=logits.device)
    scaled = logits[index].float() / sb.temperature[index, None]
    values, ids = scaled.log_softmax(dim=-1).topk(max(ks[i] for i in rows), dim=-1)
    values, ids = values.tolist(), ids.tolist()
    for j, i in enumerate(rows):
        out[i] = dict(zip(ids[j][:ks[i]], values[j][:ks[i]]))
    return out


def _sample_with_kernel(kernels, logits: torch.Tensor, sb: SamplingBatch,
                        u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, v = logits.shape
    logits = logits.contiguous()
    u = u.contiguous()
    temperature = torch.where(sb.greedy, 0.0, sb.temperature).contiguous()
    threads = torch.get_num_threads()
    work = torch.empty(threads * (v + v // 256 + 1))
    tokens, logprobs = torch.empty(b, dtype=torch.long), torch.empty(b)
    kernels.sample_rows(logits.data_ptr(), b, v, temperature.data_ptr(), u.data_ptr(),
                        tokens.data_ptr(), logprobs.data_ptr(), work.data_ptr(), threads)
    return tokens, logprobs


class StopChecker:
    """Decides whether one sequence must stop after its newest token."""

    def __init__(self, params: SamplingParams, eos_ids: Sequence[int], decode=None):
        eos = frozenset() if params.ignore_eos else frozenset(eos_ids)
        self.stop_ids = frozenset(params.stop_token_ids) | eos
        self.stop_strings = tuple(s for s in params.stop if s)
        self.decode = decode  # tokens -> text; needed only with stop strings
        if self.stop_strings and decode is None:
            raise ValueError("stop strings need a tokenizer to decode with")
        # Enough trailing tokens to contain any stop string (a token decodes to >= 1
        # character, except partial UTF-8 bytes; the margin covers those).
        self.tail = max((len(s) for s in self.stop_strings), default=0) + 8

    def is_stop(self, output_ids: list[int]) -> bool:
        """True if the newest token is a stop token or completes a stop string."""
        if output_ids[-1] in self.stop_ids:
            return True
        if not self.stop_strings:
            return False
        # Checking only the tail is enough: a stop string that was already present would
        # have stopped the sequence one step earlier.
        text = self.decode(output_ids[-self.tail:])
        return any(s in text for s in self.stop_strings)
