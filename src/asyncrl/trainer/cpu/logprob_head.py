"""Log-probs of chosen tokens through the vocabulary projection, with a hand-written backward.

For logits z = h W^T / T, the log-prob of token y is z_y - logsumexp(z), and its gradient
with respect to z is (onehot(y) - softmax(z)) / T. Autograd through `logsumexp` and
`gather` keeps fp32 logits and several fp32 temporaries per chunk, and the memory-bounded
variant recomputes the whole projection in backward. Here the forward, which computes the
softmax anyway, keeps that gradient template in the weights' dtype (bf16 in training: half
of the fp32 logits); the backward scales it by the incoming gradient and runs the two matmuls.
Templates beyond `SAVED_TEMPLATE_BYTES` are not kept: their chunks recompute the projection in
backward, so memory stays bounded whatever the batch. The kept ones share one buffer, so the
weight's gradient over them is one matmul (fp32 inside, rounded once) instead of a bf16 part
per chunk summed in an fp32 copy of the whole vocabulary; where the weight is a compute copy
with a gradient sink (the tied embedding, `trainer/cpu/precision.py`) that product goes straight
into the fp32 master's gradient. On the CPU the buffer a backward is done with is kept for the
next call (`_Spare`): at the quickstart's ~850 loss tokens it is ~84 MB, past glibc's mmap
threshold (`trainer/cpu/heap.py`), so a fresh one was a fresh mapping every step, each of its
20.4k pages a fault the kernel zeroes first (~20 ms of a step at two threads). A forward
without gradient (a recompute) takes its chunks' logits from the same buffer.

On the CPU with bf16 weights the per-row work after the projection runs in C
(`kernels/logprob_head.c`): the log-softmax, entropy and template in three passes
over each row of the bf16 logits, run from cache, the template written over them, so no
fp32 logits exist; and the backward's scaling in place. The torch code below is the path
elsewhere (no compiler, fp32, GPU) and the one the kernel is tested against.

`reference_logprobs` is the plain autograd computation the tests compare with.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Any

import torch

from asyncrl import kernels
from asyncrl.trainer.cpu import precision
from asyncrl.trainer.cpu.grad_ops import t_matmul
from asyncrl.trainer.cpu.options import cpu_paths

# Floats of one chunk of fp32 logits (128 MiB): bounds the memory of the projection.
LOGIT_CHUNK_ELEMENTS = 2**25
# Gradient templates kept from forward to backward, over all chunks of one call (256 MiB:
# ~2.7k tokens at a 49k vocabulary in bf16); chunks past it recompute in backward.
SAVED_TEMPLATE_BYTES = 2**28
# On the CPU in bf16, the rows rounded up to a multiple of this with zero rows whose results
# are dropped (their gradient is zero): oneDNN builds a matmul primitive per shape it has
# not seen (~3 ms each), and the loss-token count differs from step to step (4 new shapes,
# 14-29 ms of a quickstart step); rounded, a few recur. 1: the exact count.
ROW_MULTIPLE = 32


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor,
                   temperature: float = 1.0, with_entropy: bool = False
                   ) -> tuple[torch.Tensor, ...]:
    """(log-probs,) or (log-probs, entropies), fp32 [N], of `tokens` [N] under
    softmax(hidden [N, H] @ weight [V, H]^T / temperature). Entropies carry no gradient."""
    if hidden.dim() != 2 or tokens.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [N, H] and tokens [N], got {tuple(hidden.shape)} "
                         f"and {tuple(tokens.shape)}")
    # On the CPU (where the C kernel would read out of bounds) at no cost; on a GPU the
    # check would wait for the device twice per call, and gather asserts there anyway.
    if (tokens.device.type == "cpu" and tokens.numel()
            and not 0 <= int(tokens.min()) <= int(tokens.max()) < weight.shape[0]):
        raise ValueError(f"tokens must lie in [0, {weight.shape[0]}) (the vocabulary), got "
                         f"[{int(tokens.min())}, {int(tokens.max())}]")
    # Inside the Function grad mode is off and `needs_input_grad` ignores no_grad: ask here.
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    rows = hidden.shape[0]
    padding = -rows % ROW_MULTIPLE if _use_kernels(hidden, weight) else 0
    if padding:
        hidden = torch.cat([hidden, hidden.new_zeros(padding, hidden.shape[1])])
        tokens = torch.cat([tokens, tokens.new_zeros(padding)])
    logprobs, entropy = _TokenLogprobs.apply(hidden, weight, tokens, temperature, with_entropy,
                                             needs_grad)
    if padding:
        logprobs, entropy = logprobs[:rows], entropy[:rows] if with_entropy else entropy
    return (logprobs, entropy) if with_entropy else (logprobs,)


class _Spare:
    """One freed CPU buffer of gradient templates, kept for the next call that fits in it."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._lock = threading.Lock()  # a critic or reference model may run in another thread

    def take(self, rows: int, vocab: int, dtype: torch.dtype,
             like: torch.Tensor) -> torch.Tensor:
        """An uninitialised [rows, vocab] buffer: the kept one where it is large enough.

        A new one is sized for the most any call takes (`SAVED_TEMPLATE_BYTES`), not for
        these rows: untouched, its pages cost nothing until rows reach them, so a batch with
        more loss tokens than any before pays only for its extra rows. Sized exactly, each
        new high replaced the whole buffer, every page faulted anew: ~85 MB at the
        quickstart's ~870 loss tokens, 0.4-0.6 s of that step on a fresh virtual machine."""
        need = rows * vocab
        if cpu_paths().keep_spare_templates and like.device.type == "cpu" and rows:
            with self._lock:
                spare = self._buffer
                if spare is not None and spare.dtype == dtype and spare.numel() >= need:
                    self._buffer = None
                    return spare[:need].view(rows, vocab)
            reserve = SAVED_TEMPLATE_BYTES // dtype.itemsize
            return like.new_empty(max(need, reserve), dtype=dtype)[:need].view(rows, vocab)
        return like.new_empty((rows, vocab), dtype=dtype)

    def give(self, templates: torch.Tensor) -> None:
        """Keep the storage under `templates` (no longer used) if it is the larger one."""
        if not (cpu_paths().keep_spare_templates and templates.device.type == "cpu"
                and templates.numel()):
            return
        base = templates if templates._base is None else templates._base
        flat = base.view(-1)
        with self._lock:
            if self._buffer is None or self._buffer.numel() < flat.numel():
                self._buffer = flat


_spare = _Spare()


def chunk_rows(vocab: int) -> int:
    return max(1, LOGIT_CHUNK_ELEMENTS // vocab)




@functools.cache
def _kernels() -> ctypes.CDLL | None:
    p, i32, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    return kernels.bind("logprob_head", {"head_rows_bf16": [p, i32, i32, p, f32, p, p, i32, i32],
                                         "scale_rows_bf16": [p, i32, i32, p, i32]})


def _use_kernels(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    return (cpu_paths().logprob_kernels and hidden.device.type == "cpu"
            and weight.dtype == torch.bfloat16 and hidden.dtype == torch.bfloat16
            and _kernels() is not None)


def _chunk_forward_c(h: torch.Tensor, weight: torch.Tensor, tok: torch.Tensor,
                     temperature: float, with_entropy: bool, template: torch.Tensor | None
                     ) -> tuple[torch.Tensor, ...]:
    """`_chunk_forward` in C: the bf16 logits become the template in place. Without a
    template the logits go to the spare buffer (a recompute's chunk: ~67 MB at 682 rows)."""
    rows, vocab = h.shape[0], weight.shape[0]
    logits = template if template is not None else _spare.take(rows, vocab, weight.dtype, h)
    torch.mm(h, weight.t(), out=logits)
    tok = tok.to(torch.int64).contiguous()
    logprobs = torch.empty(rows, dtype=torch.float32)
    entropy = torch.empty(rows, dtype=torch.float32) if with_entropy else None
    _kernels().head_rows_bf16(logits.data_ptr(), rows, vocab, tok.data_ptr(), temperature,
                              logprobs.data_ptr(), entropy.data_ptr() if with_entropy else None,
                              int(template is not None), torch.get_num_threads())
    if template is None:
        _spare.give(logits)
    return logprobs, entropy


def _chunk_forward(h: torch.Tensor, weight: torch.Tensor, tok: torch.Tensor, temperature: float,
                   with_entropy: bool, template: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """One chunk: log-probs and entropies (or None); the gradient template written into
    `template` where given."""
    logits = (h @ weight.t()).float()
    if temperature != 1.0:
        logits.div_(temperature)
    lse = logits.logsumexp(-1)
    logprobs = logits.gather(-1, tok[:, None]).squeeze(-1) - lse
    if not (with_entropy or template is not None):
        return logprobs, None
    p = (logits - lse[:, None]).exp_()  # softmax
    entropy = None
    if with_entropy:  # -sum p log p = lse - sum p z (sum p = 1)
        entropy = lse - torch.bmm(p[:, None, :], logits[:, :, None]).flatten()
    del logits
    if template is not None:
        p.neg_().scatter_add_(-1, tok[:, None], torch.ones_like(logprobs)[:, None])
        if temperature != 1.0:
            p.div_(temperature)
        template.copy_(p)  # (onehot - softmax) / T, in the weights' dtype
    return logprobs, entropy


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor,
                temperature: float, with_entropy: bool, needs_grad: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = chunk_rows(weight.shape[0])
        chunk_forward = _chunk_forward_c if _use_kernels(hidden, weight) else _chunk_forward
        # The templates of the first rows that fit the budget, in one buffer: the weight's
        # gradient is then one matmul over them (`backward`); later chunks recompute theirs.
        kept = 0
        if needs_grad:
            per_row = weight.shape[0] * weight.element_size()
            kept = min(hidden.shape[0], SAVED_TEMPLATE_BYTES // per_row // rows * rows)
        templates = _spare.take(kept, weight.shape[0], weight.dtype, hidden)
        out, ent = [], []
        for start in range(0, hidden.shape[0], rows):
            h, tok = hidden[start:start + rows], tokens[start:start + rows]
            template = templates[start:start + rows] if start < kept else None
            logprobs, entropy = chunk_forward(h, weight, tok, temperature, with_entropy,
                                              template)
            out.append(logprobs)
            ent.append(entropy if entropy is not None else logprobs.new_zeros(0))
        ctx.temperature, ctx.rows, ctx.templates = temperature, rows, templates
        ctx.chunk_forward = chunk_forward
        if needs_grad:
            ctx.save_for_backward(hidden, weight, tokens)
        entropy = torch.cat(ent) if with_entropy else hidden.new_zeros(0, dtype=torch.float32)
        ctx.mark_non_differentiable(entropy)
        return torch.cat(out), entropy

    @staticmethod
    def backward(ctx: Any, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, tokens = ctx.saved_tensors
        templates, ctx.templates = ctx.templates, None  # freed when this returns
        kept = templates.shape[0]
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        want_weight = ctx.needs_input_grad[1]
        sink = precision.grad_sink(weight) if want_weight else None
        grad_weight = None  # fp32 sum of the recomputed chunks' parts (no sink)
        rows = ctx.rows
        in_c = ctx.chunk_forward is _chunk_forward_c
        for start in range(0, hidden.shape[0], rows):
            h, tok = hidden[start:start + rows], tokens[start:start + rows]
            if start < kept:
                template = templates[start:start + rows]
            else:
                template = h.new_empty((h.shape[0], weight.shape[0]), dtype=weight.dtype)
                ctx.chunk_forward(h, weight, tok, ctx.temperature, False, template)
            g = grad_logprobs[start:start + rows].float()
            if in_c:  # dL/dz in place, each product in fp32 rounded once as autograd does
                g = g.contiguous()
                _kernels().scale_rows_bf16(template.data_ptr(), *template.shape, g.data_ptr(),
                                           torch.get_num_threads())
            else:
                template.copy_(template.float().mul_(g[:, None]))
            grad_z = template
            if grad_hidden is not None:
                grad_hidden[start:start + rows] = grad_z @ weight
            if want_weight and start >= kept:  # a recomputed chunk: its own part
                if sink is not None:
                    sink.add_matmul(grad_z, h)
                    continue
                part = t_matmul(grad_z, h)
                grad_weight = part.float() if grad_weight is None else grad_weight.add_(part)
        if want_weight and kept:  # the kept chunks' part: one matmul over their rows
            if sink is not None:
                sink.add_matmul(templates, hidden[:kept])
            else:
                part = t_matmul(templates, hidden[:kept])
                grad_weight = part if grad_weight is None else grad_weight.add_(part)
        _spare.give(templates)  # nothing refers to it past this point
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def reference_logprobs(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor,
                       temperature: float = 1.0) -> torch.Tensor:
    """Plain autograd: the log-softmax of the fp32 logits at `tokens`."""
    logits = (hidden @ weight.t()).float() / temperature
    return logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
