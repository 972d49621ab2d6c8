"""Log-probs of chosen tokens through the vocabulary projection, with a hand-written backward.

For logits z = h W^T / T, the log-prob of token y is z_y - logsumexp(z), and its gradient
with respect to z is (onehot(y) - softmax(z)) / T. Autograd through `logsumexp` and
`gather` keeps fp32 logits and several fp32 temporaries per chunk, and the memory-bounded
variant recomputes the whole projection in backward. Here the forward, which computes the
softmax anyway, keeps that gradient template in the weights' dtype (bf16 in training: half
of the fp32 logits); the backward scales it by the incoming gradient and runs the two matmuls.
Templates beyond `SAVED_TEMPLATE_BYTES` are not kept: their chunks recompute the projection in
backward, so memory stays bounded whatever the batch.

On the CPU with bf16 weights the per-row work after the projection runs in C
(`engine/kernels/logprob_head.c`): the log-softmax, entropy and template in three passes
over each row of the bf16 logits, run from cache, the template written over them, so no
fp32 logits exist; and the backward's scaling in place. The torch code below is the path
elsewhere (no compiler, fp32, GPU) and the one the kernel is tested against.

`reference_logprobs` is the plain autograd computation the tests compare with.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

# Floats of one chunk of fp32 logits (128 MiB): bounds the memory of the projection.
LOGIT_CHUNK_ELEMENTS = 2**25
# Gradient templates kept from forward to backward, over all chunks of one call (256 MiB:
# ~2.7k tokens at a 49k vocabulary in bf16); chunks past it recompute in backward.
SAVED_TEMPLATE_BYTES = 2**28


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
    logprobs, entropy = _TokenLogprobs.apply(hidden, weight, tokens, temperature, with_entropy,
                                             needs_grad)
    return (logprobs, entropy) if with_entropy else (logprobs,)


def chunk_rows(vocab: int) -> int:
    return max(1, LOGIT_CHUNK_ELEMENTS // vocab)


# The C kernels where they apply (tests switch them off to run the torch path).
USE_KERNELS = True


@functools.cache
def _kernels() -> ctypes.CDLL | None:
    from asyncrl.engine import kernels

    p, i32, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    return kernels.bind("logprob_head", {"head_rows_bf16": [p, i32, i32, p, f32, p, p, i32, i32],
                                         "scale_rows_bf16": [p, i32, i32, p, i32]})


def _use_kernels(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    return (USE_KERNELS and hidden.device.type == "cpu" and weight.dtype == torch.bfloat16
            and hidden.dtype == torch.bfloat16 and _kernels() is not None)


def _chunk_forward_c(h: torch.Tensor, weight: torch.Tensor, tok: torch.Tensor,
                     temperature: float, with_entropy: bool, template: bool
                     ) -> tuple[torch.Tensor, ...]:
    """`_chunk_forward` in C: the bf16 logits become the template in place."""
    logits = h @ weight.t()
    rows, vocab = logits.shape
    tok = tok.to(torch.int64).contiguous()
    logprobs = torch.empty(rows, dtype=torch.float32)
    entropy = torch.empty(rows, dtype=torch.float32) if with_entropy else None
    _kernels().head_rows_bf16(logits.data_ptr(), rows, vocab, tok.data_ptr(), temperature,
                              logprobs.data_ptr(), entropy.data_ptr() if with_entropy else None,
                              int(template), torch.get_num_threads())
    return logprobs, entropy, logits if template else None


def _chunk_forward(h: torch.Tensor, weight: torch.Tensor, tok: torch.Tensor, temperature: float,
                   with_entropy: bool, template: bool) -> tuple[torch.Tensor, ...]:
    """One chunk: log-probs, entropies (or None) and the gradient template (or None)."""
    logits = (h @ weight.t()).float()
    if temperature != 1.0:
        logits.div_(temperature)
    lse = logits.logsumexp(-1)
    logprobs = logits.gather(-1, tok[:, None]).squeeze(-1) - lse
    if not (with_entropy or template):
        return logprobs, None, None
    p = (logits - lse[:, None]).exp_()  # softmax
    entropy = None
    if with_entropy:  # -sum p log p = lse - sum p z (sum p = 1)
        entropy = lse - torch.bmm(p[:, None, :], logits[:, :, None]).flatten()
    del logits
    grad = None
    if template:
        p.neg_().scatter_add_(-1, tok[:, None], torch.ones_like(logprobs)[:, None])
        if temperature != 1.0:
            p.div_(temperature)
        grad = p.to(weight.dtype)  # (onehot - softmax) / T
    return logprobs, entropy, grad


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor,
                temperature: float, with_entropy: bool, needs_grad: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = chunk_rows(weight.shape[0])
        chunk_forward = _chunk_forward_c if _use_kernels(hidden, weight) else _chunk_forward
        budget = SAVED_TEMPLATE_BYTES if needs_grad else -1
        out, ent, templates = [], [], []
        for start in range(0, hidden.shape[0], rows):
            h, tok = hidden[start:start + rows], tokens[start:start + rows]
            size = h.shape[0] * weight.shape[0] * weight.element_size()
            keep = 0 <= size <= budget
            logprobs, entropy, grad = chunk_forward(h, weight, tok, temperature,
                                                    with_entropy, keep)
            if keep:
                budget -= size
            out.append(logprobs)
            ent.append(entropy if entropy is not None else logprobs.new_zeros(0))
            templates.append(grad)  # None: recompute in backward
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
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        rows = ctx.rows
        in_c = ctx.chunk_forward is _chunk_forward_c
        grad_weight = None
        for i, start in enumerate(range(0, hidden.shape[0], rows)):
            h, tok = hidden[start:start + rows], tokens[start:start + rows]
            template = ctx.templates[i]
            if template is None:
                template = ctx.chunk_forward(h, weight, tok, ctx.temperature, False, True)[2]
            ctx.templates[i] = None  # free it as soon as it is used
            g = grad_logprobs[start:start + rows].float()
            if in_c:  # dL/dz in place, each product in fp32 rounded once as autograd does
                g = g.contiguous()
                _kernels().scale_rows_bf16(template.data_ptr(), *template.shape, g.data_ptr(),
                                           torch.get_num_threads())
                grad_z = template
            else:
                grad_z = (template.float().mul_(g[:, None])).to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[start:start + rows] = grad_z @ weight
            if ctx.needs_input_grad[1]:
                part = grad_z.t() @ h
                if grad_weight is None:
                    grad_weight = part
                else:  # several chunks: their parts summed in fp32
                    if grad_weight.dtype != torch.float32:
                        grad_weight = grad_weight.float()
                    grad_weight.add_(part)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def reference_logprobs(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor,
                       temperature: float = 1.0) -> torch.Tensor:
    """Plain autograd: the log-softmax of the fp32 logits at `tokens`."""
    logits = (hidden @ weight.t()).float() / temperature
    return logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
