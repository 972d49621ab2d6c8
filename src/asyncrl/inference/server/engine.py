"""The local inference engine: continuous batching over a static slot KV cache.

One thread runs `step()` in a loop. A step (1) applies pending weight updates, (2) admits
waiting requests into free slots and prefills them together, (3) decodes one token for
every active sequence in one forward. Requests join and leave between steps.

A weight update does not wait for generations to end: the new weights are read, checked
and prepared in the caller's thread (decoding goes on meanwhile), then swapped in at the
next step boundary. In-flight sequences continue under the new weights and their later
tokens carry the new version. With `recompute_kv_on_update`, their KV cache is recomputed
first, so every later token is sampled exactly from the new policy. The new weights are
written into the buffers of the weights the previous update swapped out (one update at a
time), and swapped in, with their version, only once every tensor has come: an update
that fails half-way leaves the served weights and version as they were.

`step()` can also be driven by hand (without `start()`), which makes tests deterministic.

A vision-language model (inference/server/vision.py) takes requests with images: at
prefill, its vision encoder turns them into the embeddings of the prompt's image tokens.
Prompts share computed prefixes by keys, not token ids: an image token's key is a hash of
its prompt's pixels, so equal tokens with other pixels are another prefix, while a GRPO
group's samples (same text, same image) run the encoder and the prompt once. A prompt
takes a shared prefix only if it covers all its image tokens; what it computes past the
prefix is then text.

A Mixture-of-Experts model's responses carry the experts each MoE layer chose for each
token the engine ran (prefill and decode), for routing replay in the trainer.

One thread does the multi-threaded torch work of a serving process (`LocalEngine.spawn`
loads the model and runs the loop in the same thread; weights for an update are prepared
single-threaded). libgomp throttles its spin-waiting for good once threads of more than one
OpenMP team outnumber the cores, and every parallel region then pays a futex wake-up:
decode ran ~1.5x slower with the model loaded in one thread and decoded in another.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from asyncrl.api.cores import CoreShare
from asyncrl.api.types import GenerationRequest, GenerationResponse, ImageInputs, StopReason
from asyncrl.config.schema import LocalEngineConfig
from asyncrl.inference.server import memory
from asyncrl.inference.server.memory import PREFILL_TOKEN_BUDGET
from asyncrl.inference.server.model import (
    DTYPES,
    CheckpointError,
    Transformer,
    Weights,
    checkpoint_files,
    hf_shapes,
    load_config,
    mapped_checkpoint,
    read_checkpoint_file,
)
from asyncrl.inference.server.sampling import SamplingBatch, StopChecker, sample, top_logprobs
from asyncrl.inference.server.vision import VisionEncoder, is_vision_language
from asyncrl.models import lora
from asyncrl.models.hub import resolve_model_path

logger = logging.getLogger(__name__)

Callback = Callable[["GenerationResponse | BaseException"], None]
# Called from the engine thread with (token id, log-prob, weight version) of each new token.
TokenCallback = Callable[[int, float, int], None]
# PREFILL_TOKEN_BUDGET: padded tokens per prefill forward; bounds the pause that admitting
# requests imposes on the sequences already decoding (and the activation memory of one
# prefill, which memory.py reserves).
# A prompt admitted with another that starts with the same tokens takes that prefix's keys
# and values from it instead of computing them, from this many shared tokens on.
MIN_SHARED_PREFIX = 8


@dataclass(eq=False)
class _Seq:
    req: GenerationRequest
    on_done: Callback
    stop: StopChecker
    t_submit: float
    on_token: TokenCallback | None = None
    # the prompt's tokens as the C forward shares prefixes by: image tokens replaced by a
    # key of the pixels (`_prompt_keys`); shared past its image tokens only (image_end)
    keys: list[int] = field(default_factory=list)
    image_end: int = 0
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    tops: list[dict[int, float]] = field(default_factory=list)  # with sampling.top_logprobs
    kv_current: bool = True  # its cached keys and values come from the current weights
    # MoE: the experts chosen for its tokens so far, in order, as chunks [n, layers, top_k]
    routes: list[torch.Tensor] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return len(self.req.input_ids) + len(self.output_ids)

    def kv_tokens(self) -> list[int]:
        """The tokens whose keys and values are in the cache (all but the newest)."""
        return self.req.input_ids + self.output_ids[:-1]

    def kv_keys(self) -> list[int]:
        """`kv_tokens` as prefixes are shared by (the prompt's `keys`)."""
        return self.keys + self.output_ids[:-1]

    def response(self, reason: StopReason) -> GenerationResponse:
        routes = None
        if self.routes:  # the newest token was never run through the model: -1
            routes = torch.cat(self.routes)
            routes = torch.cat([routes, torch.full_like(routes[:1], -1)])
        return GenerationResponse(
            rid=self.req.rid, input_ids=list(self.req.input_ids), output_ids=self.output_ids,
            output_logprobs=self.logprobs, output_versions=self.versions, stop_reason=reason,
            latency_s=time.monotonic() - self.t_submit, routed_experts=routes,
            output_top_logprobs=self.tops if self.req.sampling.top_logprobs else None)


def eos_token_ids(path: str, tokenizer) -> list[int]:
    """The model's EOS ids: the tokenizer's and generation_config.json's (else config.json's)."""
    ids = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    for name in ("generation_config.json", "config.json"):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                ids.update(eos if isinstance(eos, list) else [eos])
                break
    return sorted(ids)


class LocalEngine:
    """Continuous-batching generation on our own decoder, with interruptible weight updates."""

    def __init__(self, model_path: str, config: LocalEngineConfig | None = None, *, seed: int = 0,
                 device: str = "cpu", gpu_memory_fraction: float | None = None,
                 kv_budget_bytes: int | None = None):
        """`gpu_memory_fraction` (CUDA): the share of the GPU this engine may take; its KV
        cache gets what the weights and a step leave of it (memory.py). `kv_budget_bytes`:
        the cache's bytes given directly (any device). Either may leave fewer slots than
        `config.max_batch_size` (then `config.max_batch_size` is that number)."""
        from transformers import AutoTokenizer

        self.config = config or LocalEngineConfig()
        self.model_path = resolve_model_path(model_path)
        if gpu_memory_fraction is not None:
            if torch.device(device).type != "cuda":
                raise ValueError(f"gpu_memory_fraction={gpu_memory_fraction} is for a CUDA "
                                 f"device, not {device!r}")
            # the allocator's cap: a step that needs more fails here, not in the trainer
            index = torch.device(device).index
            torch.cuda.set_per_process_memory_fraction(
                gpu_memory_fraction, torch.cuda.current_device() if index is None else index)
        self.model = Transformer.from_pretrained(self.model_path, dtype=DTYPES[self.config.dtype],
                                                 max_seq_len=self.config.max_seq_len, device=device)
        self._size_cache(device, gpu_memory_fraction, kv_budget_bytes)
        self.cache = self.model.new_cache(self.config.max_batch_size, self.config.max_seq_len)
        self.vision: VisionEncoder | None = None  # a vision-language model's image side
        _, raw = load_config(self.model_path)
        if is_vision_language(raw):
            tensors = {n: t for f in checkpoint_files(self.model_path)
                       for n, t in read_checkpoint_file(f).items() if VisionEncoder.own(n)}
            self.vision = VisionEncoder(raw, tensors, dtype=self.model.dtype,
                                        device=torch.device(device))
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.eos_ids = eos_token_ids(self.model_path, self.tokenizer)
        self.version = 0
        self.device = torch.device(device)
        self._generator = torch.Generator(device=device).manual_seed(seed)

        self._waiting: collections.deque[_Seq] = collections.deque()
        self._active: list[_Seq] = []  # active[i] lives in cache slot i
        self._sampling: SamplingBatch | None = None  # rebuilt when the active set changes
        n = self.config.max_batch_size
        self._last_token = torch.zeros(n, dtype=torch.long, device=device)  # next decode input
        self._position = torch.zeros(n, dtype=torch.long, device=device)  # its position

        # (decoder weights, vision tensors of a vision-language model, version, done)
        self._updates: list[tuple[Weights, dict[str, torch.Tensor] | None, int,
                                  concurrent.futures.Future]] = []
        self._update_lock = threading.Lock()  # one update at a time: they share the spare
        self._spare: Weights | None = None  # swapped out by the last update; written by the next
        self._paused = False
        self._stopping = False
        self._cond = threading.Condition()
        self._step_lock = threading.Lock()  # held for the whole of a step
        self._thread: threading.Thread | None = None
        self._share: CoreShare | None = None  # set by `spawn`

    def _size_cache(self, device: str, fraction: float | None, budget: int | None) -> None:
        """Cut `config.max_batch_size` to the cache slots that fit the budget, if any."""
        cfg, dtype, n = self.config, self.model.dtype, self.config.max_batch_size
        what = f"kv_budget_bytes={budget}"
        if budget is None and fraction is not None:
            total = torch.cuda.get_device_properties(torch.device(device)).total_memory
            weights = sum(t.numel() * t.element_size() for t in self.model.w._storage)
            reserve = memory.activation_reserve(self.model.cfg, dtype, n, cfg.max_seq_len)
            budget = memory.kv_budget(fraction, total, weights, reserve)
            what = (f"rollout.gpu_memory_fraction={fraction} of {total / 2**30:.1f} GiB, less "
                    f"the weights twice ({2 * weights / 2**20:.0f} MiB) and a step's tensors "
                    f"({reserve / 2**20:.0f} MiB),")
        if budget is None:
            return
        slots = memory.kv_slots(budget, memory.kv_slot_bytes(self.model.cfg, dtype,
                                                             cfg.max_seq_len), n, what=what)
        if slots < n:
            logger.warning("%s holds %d KV-cache slots of %d positions, fewer than "
                           "local_engine.max_batch_size=%d: at most %d sequences decode at once",
                           what.rstrip(","), slots, cfg.max_seq_len, n, slots)
            self.config = dataclasses.replace(cfg, max_batch_size=slots)

    # ---- public API (any thread) -------------------------------------------------------

    @classmethod
    def spawn(cls, model_path: str, config: LocalEngineConfig | None = None, *, seed: int = 0,
              device: str = "cpu", threads: int | None = None,
              share: CoreShare | None = None,
              gpu_memory_fraction: float | None = None) -> LocalEngine:
        """Load the model in a new daemon thread and run the loop there (see the module doc).

        `share`: this server's part of a core share (api/cores.py): the loop is busy while
        it has sequences and sets its thread count before every step.
        """
        made: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if threads:
                torch.set_num_threads(threads)
            try:
                engine = cls(model_path, config, seed=seed, device=device,
                             gpu_memory_fraction=gpu_memory_fraction)
            except BaseException as e:  # handed to the caller below
                made.set_exception(e)
                return
            engine._share = share
            engine._thread = threading.current_thread()
            made.set_result(engine)
            engine._loop()

        threading.Thread(target=run, name="asyncrl-engine", daemon=True).start()
        return made.result()

    def start(self) -> None:
        """Run the scheduling loop in a daemon thread."""
        self._thread = threading.Thread(target=self._loop, name="asyncrl-engine", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the loop; requests still queued or running fail with RuntimeError."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error = RuntimeError("the inference engine was shut down")
        with self._cond:
            updates, self._updates = self._updates, []
        for *_, done in updates:
            done.set_exception(error)
        self._fail_all(error)

    def submit(self, req: GenerationRequest, on_done: Callback,
               on_token: TokenCallback | None = None) -> None:
        """Queue `req`; `on_done` later gets its response or exception, from the engine thread.

        `on_token`, if given, gets each token as it is sampled (before `on_done`); it runs in
        the engine thread, so it must only hand the token over (e.g. call_soon_threadsafe).
        """
        self._check_request(req)
        seq = _Seq(req=req, on_done=on_done, t_submit=time.monotonic(), on_token=on_token,
                   stop=StopChecker(req.sampling, self.eos_ids, self._decode_text))
        if req.images is None:
            seq.keys = req.input_ids
        elif self.model.fused:  # only the C forward shares prefixes: hash the pixels for it
            seq.keys, seq.image_end = _prompt_keys(req.input_ids, self.vision.image_token_id,
                                                   req.images)
        with self._cond:
            if self._stopping:
                raise RuntimeError("the inference engine was shut down")
            self._waiting.append(seq)
            self._cond.notify_all()

    def score(self, input_ids: list[int], top_k: int = 0,
              timeout: float = 600.0) -> tuple[list[float | None], list[dict[int, float] | None]]:
        """The log-prob of each token of `input_ids` given those before it (the first: None),
        and with `top_k` > 0 the `top_k` most likely tokens {id: log-prob} at each position
        (the first: None): log_softmax of the current weights' logits, no temperature.

        Runs between steps in a free cache slot (waiting up to `timeout` s for one).
        """
        self._check_request(GenerationRequest(input_ids=list(input_ids)))
        deadline = time.monotonic() + timeout
        while True:
            with self._step_lock:
                slot = len(self._active)
                if slot < self.config.max_batch_size:
                    tokens = torch.tensor([input_ids], device=self.device)
                    lengths = torch.tensor([len(input_ids)], device=self.device)
                    logits = self.model.prefill(tokens, lengths, self.cache, slot,
                                                all_logits=True)[0, :-1].float()
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"no free cache slot to score a prompt within {timeout} s")
            time.sleep(0.01)
        logprobs = logits.log_softmax(dim=-1)
        picked = logprobs.gather(-1, torch.tensor(input_ids[1:], device=logits.device)[:, None])
        tops: list[dict[int, float] | None] = [None] * len(input_ids)
        if top_k > 0:
            values, ids = logprobs.topk(top_k, dim=-1)
            tops[1:] = [dict(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
        return [None, *picked[:, 0].tolist()], tops

    def generate(self, req: GenerationRequest, timeout: float | None = None) -> GenerationResponse:
        """Submit and block until done (needs `start()`, or another thread calling `step()`)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.submit(req, lambda r: fut.set_exception(r) if isinstance(r, BaseException)
                    else fut.set_result(r))
        return fut.result(timeout)

    def pause(self) -> None:
        """Stop decode steps; returns once the step in progress (if any) has ended."""
        with self._cond:
            self._paused = True
        with self._step_lock:
            pass

    def resume(self) -> None:
        """Continue decoding after `pause`."""
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def update_weights(self, path: str, version: int) -> None:
        """Load the safetensors folder `path` as weight version `version` at the next step boundary.

        The new weights are read and prepared in the calling thread while decoding goes on;
        only the swap waits for the step boundary. Raises (CheckpointError, OSError) without
        touching the weights or the version if the folder does not fit.

        A LoRA adapter folder (PEFT's format, what a LoRA trainer publishes) is merged into
        the base weights of `model_path`, read again from their file at each update
        (W + scaling * B @ A in fp32, then cast as any loaded weight): the engine computes
        with merged weights, as fast as without adapters.
        """
        if lora.is_adapter_folder(path):
            try:
                adapter = lora.read_adapter(path)
            except (lora.AdapterError, OSError) as e:
                raise CheckpointError(f"cannot read the adapter in {path!r}: {e}") from e
            with mapped_checkpoint(self.model_path, hf_shapes(self.model.cfg),
                                   self.model.cfg.foreign_prefixes) as base:
                try:
                    self.load_weights(lora.merged(base.items(), adapter), version)
                except lora.AdapterError as e:
                    raise CheckpointError(f"adapter {path!r} does not fit the base "
                                          f"{self.model_path!r}: {e}") from e
            return
        with mapped_checkpoint(path, hf_shapes(self.model.cfg),
                               self.model.cfg.foreign_prefixes) as tensors:
            self.load_weights(tensors.items(), version)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Weights from (HF name, tensor) pairs as they come (a file's, or a broadcast's
        buckets as they arrive), served as `version` from the next step boundary on.

        Each tensor is copied into place as it comes (decoding goes on meanwhile); the swap
        happens once all have come. If the pairs raise, or a tensor is missing, unexpected or
        mis-shaped (CheckpointError), the served weights and version stay as they were.
        """
        with self._update_lock:
            if self._share is not None:
                # The copy takes a core: a trainer borrowing this server's gives it back
                # (api/cores.py). The loop clears the flag when it next idles: after the
                # swap, or at once if the load fails (woken below).
                with self._cond:
                    self._share.set_busy(True)
            try:
                with _single_threaded():  # the engine thread keeps the only OpenMP team
                    weights = self.model.new_weights(reuse=self._spare)
                    self._spare = weights  # still spare until it is swapped in
                    seen = {} if self.vision is not None else None
                    for name, tensor in named_tensors:
                        if seen is not None and VisionEncoder.own(name):
                            seen[name] = tensor.to(torch.float32, copy=True)
                        weights.load(name, tensor)
                    weights.finish()
                    if seen is not None:
                        self._check_vision_update(seen)
            except BaseException:
                with self._cond:
                    self._cond.notify_all()
                raise
            self._spare = None
            done: concurrent.futures.Future = concurrent.futures.Future()
            with self._cond:
                self._updates.append((weights, seen, version, done))
                self._cond.notify_all()
            if self._thread is None:  # driven by hand: between two step() calls is a boundary
                with self._step_lock:
                    self._apply_updates()
            done.result()

    def _check_vision_update(self, tensors: dict[str, torch.Tensor]) -> None:
        """CheckpointError unless `tensors` are the whole vision side, in its shapes."""
        shapes = self.vision.shapes()
        missing = sorted(set(shapes) - set(tensors))
        unexpected = sorted(set(tensors) - set(shapes))
        bad = [f"{n}: {tuple(t.shape)} != expected {shapes[n]}" for n, t in tensors.items()
               if n in shapes and tuple(t.shape) != shapes[n]]
        if missing or unexpected or bad:
            raise CheckpointError(f"the update's vision tensors do not fit the model: missing "
                                  f"{missing[:5]}, unexpected {unexpected[:5]}, mis-shaped "
                                  f"{bad[:5]}")

    def weights_digest(self) -> dict:
        """The served version and the sha256 of its weights (equal weights, equal digests)."""
        with self._step_lock:  # not mid-swap
            return {"version": self.version, "sha256": self.model.w.digest()}

    def stats(self) -> dict:
        """Counts for /health: running and waiting requests, paused flag, weight version."""
        with self._cond:
            return {"version": self.version, "running": len(self._active),
                    "waiting": len(self._waiting), "paused": self._paused}

    # ---- the loop (engine thread) -----------------------------------------------------

    def _loop(self) -> None:
        share = self._share
        while True:
            with self._cond:
                while not self._stopping and not self._updates and (
                        self._paused or not (self._waiting or self._active)):
                    if share is not None:
                        share.set_busy(False)
                    self._cond.wait()
                if self._stopping:
                    return
            if share is not None:
                share.set_busy(True)
                share.adjust()
            try:
                self.step()
            except Exception as e:  # a bug in a step must not hang every caller: fail them
                logger.exception("inference step failed; failing all requests")
                self._fail_all(e)

    def step(self) -> None:
        """One scheduling iteration: apply weight updates, admit waiting requests, decode once.

        With the C forward, requests admitted while others decode are prefilled in the same
        pass as the others' next token (one pass over the weights instead of two).
        """
        with self._step_lock:
            self._apply_updates()
            if self._paused:
                return
            n_old = len(self._active)
            new = self._take_waiting()
            if new and self.model.fused:
                self._mixed_step(n_old, new)
                return
            if new:
                self._first_tokens(n_old, new)
            if self._active:
                self._decode_step()

    def _apply_updates(self) -> None:
        with self._cond:
            updates, self._updates = self._updates, []
        for weights, vision_tensors, version, done in updates:
            self._spare, self.model.w = self.model.w, weights
            if vision_tensors is not None:
                self.vision.load(vision_tensors.items())
            self.version = version
            if self.config.recompute_kv_on_update and self._active:
                kv_tokens = [s.kv_tokens() for s in self._active]
                if self.model.fused:  # shared prefixes (a group's prompt) computed once
                    self._forward_prompts(0, self._active, kv_tokens, decode=False)
                else:
                    self._prefill(self._active, 0, kv_tokens)
            else:
                for seq in self._active:  # not a prefix to share with new requests any more
                    seq.kv_current = False
            done.set_result(None)

    def _take_waiting(self) -> list[_Seq]:
        """Move waiting requests into the free slots after the active ones, within the budget."""
        with self._cond:
            free = self.config.max_batch_size - len(self._active)
            new: list[_Seq] = []
            width = 0
            while self._waiting and len(new) < free:
                width_next = max(width, len(self._waiting[0].req.input_ids))
                if new and width_next * (len(new) + 1) > PREFILL_TOKEN_BUDGET:
                    break
                new.append(self._waiting.popleft())
                width = width_next
        self._active.extend(new)
        if new:
            self._sampling = None
        return new

    def _first_tokens(self, start: int, new: list[_Seq]) -> None:
        """Prefill the prompts of `new` (slots start..) and sample their first tokens."""
        logits = self._prefill(new, start, [s.req.input_ids for s in new])
        sb = SamplingBatch.from_params([s.req.sampling for s in new], self.device)
        tokens, logprobs = sample(logits, sb, self._generator, _draws(sb, new))
        self._last_token[start:start + len(new)] = tokens
        self._position[start:start + len(new)] = torch.tensor(
            [len(s.req.input_ids) for s in new], device=self.device)
        self._record(start, tokens, logprobs, _tops(logits, sb, new))

    def _prefill(self, seqs: list[_Seq], start: int, token_lists: list[list[int]]) -> torch.Tensor:
        """Prefill `token_lists` into slots start.., in budget-sized chunks; last logits [n, V].

        MoE: each sequence's recorded experts become those of its prefilled tokens (a
        recomputed cache's tokens are routed again under the new weights)."""
        out, i = [], 0
        while i < len(seqs):
            j, width = i + 1, len(token_lists[i])
            while j < len(seqs):
                wider = max(width, len(token_lists[j]))
                if wider * (j + 1 - i) > PREFILL_TOKEN_BUDGET:
                    break
                width, j = wider, j + 1
            chunk = token_lists[i:j]
            tokens = torch.zeros(len(chunk), width, dtype=torch.long)
            for r, toks in enumerate(chunk):
                tokens[r, :len(toks)] = torch.tensor(toks)
            lengths = torch.tensor([len(t) for t in chunk])
            out.append(self.model.prefill(tokens.to(self.device), lengths.to(self.device),
                                          self.cache, start + i,
                                          embeds=self._image_embeds(seqs[i:j], tokens)))
            if self.model.last_routes is not None:
                routes = self.model.last_routes.cpu()
                for r, toks in enumerate(chunk):
                    seqs[i + r].routes = [routes[r, :len(toks)]]
            i = j
        return torch.cat(out)

    def _image_embeds(self, seqs: list[_Seq], tokens: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(mask, values) of the image tokens of `seqs`' rows of `tokens` [n, T] and their
        features (`Transformer.prefill`'s `embeds`); None if no row has images."""
        rows = [r for r, s in enumerate(seqs) if s.req.images is not None]
        if not rows:
            return None
        mask = torch.zeros(tokens.shape, dtype=torch.bool)
        mask[rows] = tokens[rows] == self.vision.image_token_id
        values = torch.cat([self.vision.embed(seqs[r].req.images) for r in rows])
        return mask.to(self.device), values

    def _mixed_step(self, n_old: int, new: list[_Seq]) -> None:
        """Next tokens of slots 0..n_old-1 and first tokens of `new` (slots n_old..), in the
        same forward (see `_forward_prompts`)."""
        prompts = [s.req.input_ids for s in new]
        # running sequences share what their cache holds (only from the current weights)
        cached = [s.kv_keys() if s.kv_current else [] for s in self._active[:n_old]]
        logits = self._forward_prompts(n_old, new, prompts, decode=True, cached=cached)
        self._sampling = SamplingBatch.from_params([s.req.sampling for s in self._active],
                                                   self.device)
        tokens, logprobs = sample(logits, self._sampling, self._generator,
                                  _draws(self._sampling, self._active))
        n = len(self._active)
        self._last_token[:n] = tokens
        self._position[:n_old] += 1
        self._position[n_old:n] = torch.tensor([len(p) for p in prompts])
        self._record(0, tokens, logprobs, _tops(logits, self._sampling, self._active))

    def _forward_prompts(self, base: int, seqs: list[_Seq], prompts: list[list[int]], *,
                         decode: bool, cached: Sequence[list[int]] = ()) -> torch.Tensor:
        """Keys and values of `prompts` (the tokens of `seqs` to compute: their prompts, or
        all cached tokens) into slots base.. and the logits of their last tokens, with the C
        forward; with `decode`, the first forward also holds the decode rows of slots
        0..base-1 (logits [base + len(prompts), V], else [len(prompts), V]).

        A prompt that shares a prefix of at least MIN_SHARED_PREFIX tokens (and past its
        image tokens) with one of `cached` (the keys of the tokens slots 0.. hold, as
        `_Seq.kv_keys`) or with an earlier prompt (a GRPO group's samples share all of it)
        gets that prefix's keys and values copied from there and computes only the rest;
        prompts that share with an earlier prompt run in a second, smaller forward. Each
        row's maths is independent of the others', so the results are bit-identical to
        computing every prompt in full.
        """
        n_dec = base if decode else 0
        keys = [s.keys + p[len(s.keys):] for s, p in zip(seqs, prompts)]
        need = [max(MIN_SHARED_PREFIX, s.image_end) for s in seqs]
        donor, shared = _shared_prefixes(keys, need, cached)
        # donors index cached + prompts; both are laid out from slot 0 (cached) and `base`
        slot_of = [d if d < len(cached) else base + d - len(cached) for d in donor]
        for i, d in enumerate(donor):
            if 0 <= d < len(cached):
                self.cache.move(slot_of[i], base + i, shared[i])
        full = [i for i in range(len(prompts)) if donor[i] < len(cached)]
        dependent = [i for i in range(len(prompts)) if donor[i] >= len(cached)]
        logits = torch.empty(n_dec + len(prompts), self.model.cfg.vocab_size,
                             dtype=self.model.dtype)
        # the decode rows, and the prompts computed past any prefix from the cache; those
        # computed from the start with their images
        rows = self._prompt_rows(base, [(i, shared[i]) for i in full], prompts)
        dec = torch.arange(n_dec)
        tokens = torch.cat([self._last_token[:n_dec], rows[0]])
        logits[torch.cat([dec, n_dec + torch.tensor(full, dtype=torch.long)])] = \
            self.model.forward_rows(
                tokens, torch.cat([dec, rows[1]]), torch.cat([self._position[:n_dec], rows[2]]),
                self.cache, torch.cat([dec, n_dec + rows[3]]),
                self._row_images([seqs[i] for i in full if shared[i] == 0], n_dec, tokens))
        if dependent:
            for i in dependent:  # the shared prefix's keys and values, from the donor's slot
                self.cache.move(slot_of[i], base + i, shared[i])
            rows = self._prompt_rows(base, [(i, shared[i]) for i in dependent], prompts)
            logits[n_dec + torch.tensor(dependent)] = self.model.forward_rows(
                rows[0], rows[1], rows[2], self.cache, rows[3])
        return logits

    def _row_images(self, seqs: list[_Seq], n_dec: int, tokens: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`forward_rows`' embeds for rows `tokens` [R]: the features of the images of
        `seqs`, the prompts those rows compute from their first token, at their image
        tokens (the first `n_dec` rows, decode rows, hold none); None if none has images."""
        with_images = [s.req.images for s in seqs if s.req.images is not None]
        if not with_images:
            return None
        mask = tokens == self.vision.image_token_id
        mask[:n_dec] = False
        # one encoder call per prompt, as when it runs alone (a batched call may round
        # otherwise, and a request's log-probs must not depend on what it is batched with)
        return mask, torch.cat([self.vision.embed(images) for images in with_images])

    @staticmethod
    def _prompt_rows(base: int, parts: list[tuple[int, int]], prompts: list[list[int]]):
        """(tokens, slots, positions, last-row indices) of prompts[i][start:] for (i, start),
        prompt i in slot base + i."""
        tokens, slots, positions, last = [], [], [], []
        for i, start in parts:
            tokens += prompts[i][start:]
            slots += [base + i] * (len(prompts[i]) - start)
            positions += range(start, len(prompts[i]))
            last.append(len(tokens) - 1)
        long = dict(dtype=torch.long)
        return (torch.tensor(tokens, **long), torch.tensor(slots, **long),
                torch.tensor(positions, **long), torch.tensor(last, **long))

    def _decode_step(self) -> None:
        n = len(self._active)
        if self._sampling is None:
            params = [s.req.sampling for s in self._active]
            self._sampling = SamplingBatch.from_params(params, self.device)
        kv_len = max(s.n_tokens for s in self._active)  # positions so far, newest token included
        logits = self.model.decode(self._last_token[:n], self._position[:n], self.cache, kv_len)
        if self.model.last_routes is not None:
            routes = self.model.last_routes.cpu()
            for i, seq in enumerate(self._active):
                seq.routes.append(routes[i:i + 1])
        tokens, logprobs = sample(logits, self._sampling, self._generator,
                                  _draws(self._sampling, self._active))
        self._last_token[:n] = tokens
        self._position[:n] += 1
        self._record(0, tokens, logprobs, _tops(logits, self._sampling, self._active))

    def _record(self, start: int, tokens: torch.Tensor, logprobs: torch.Tensor,
                tops: list[dict[int, float] | None] | None = None) -> None:
        """Append the sampled tokens (and any top log-probs) to sequences start.. and retire
        those that stop."""
        finished: list[tuple[int, StopReason]] = []
        for i, (tok, lp) in enumerate(zip(tokens.tolist(), logprobs.tolist()), start):
            seq = self._active[i]
            seq.output_ids.append(tok)
            seq.logprobs.append(lp)
            seq.versions.append(self.version)
            if tops is not None and tops[i - start] is not None:
                seq.tops.append(tops[i - start])
            if seq.on_token is not None:
                seq.on_token(tok, lp, self.version)
            if seq.stop.is_stop(seq.output_ids):
                finished.append((i, StopReason.STOP))
            elif (len(seq.output_ids) >= seq.req.sampling.max_new_tokens
                  or seq.n_tokens >= self.config.max_seq_len):
                finished.append((i, StopReason.LENGTH))
        # Highest slot first: the last active sequence moved into a freed slot is then
        # always one that is not finishing.
        for i, reason in reversed(finished):
            seq = self._retire(i)
            seq.on_done(seq.response(reason))

    def _retire(self, i: int) -> _Seq:
        """Free slot i; the last active sequence moves into it to keep slots 0..n-1 dense."""
        seq, last = self._active[i], len(self._active) - 1
        if i != last:
            moved = self._active[last]
            self.cache.move(last, i, moved.n_tokens - 1)
            self._last_token[i] = self._last_token[last]
            self._position[i] = self._position[last]
            self._active[i] = moved
        self._active.pop()
        self._sampling = None
        return seq

    # ---- helpers -----------------------------------------------------------------------

    def _check_request(self, req: GenerationRequest) -> None:
        n, vocab = len(req.input_ids), self.model.cfg.vocab_size
        if n == 0:
            raise ValueError("input_ids is empty")
        if n >= self.config.max_seq_len:
            raise ValueError(f"input_ids has {n} tokens; max_seq_len={self.config.max_seq_len} "
                             "leaves no room to generate")
        bad = [t for t in req.input_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"input_ids holds ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if req.images is not None and self.vision is None:
            raise ValueError(f"the request has images but the model {self.model_path!r} reads "
                             "text only; send its prompt without images")
        if self.vision is not None:
            n_image = req.input_ids.count(self.vision.image_token_id)
            if req.images is None and n_image:
                raise ValueError(f"input_ids holds {n_image} image tokens (id "
                                 f"{self.vision.image_token_id}) but the request has no images")
            if req.images is not None:
                self.vision.check(req.images, n_image)

    def _decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            seqs = list(self._waiting) + self._active
            self._waiting.clear()
            self._active = []
            self._sampling = None
        for seq in seqs:
            seq.on_done(error)


def _prompt_keys(input_ids: list[int], image_token_id: int,
                 images: ImageInputs) -> tuple[list[int], int]:
    """(keys, image_end) of a prompt with images: its tokens, with each image token
    replaced by one negative key for the prompt's images (a hash of their pixels); and the
    index after its last image token."""
    key = -1 - int.from_bytes(images.digest()[:7], "little")
    keys = [key if t == image_token_id else t for t in input_ids]
    return keys, max((i + 1 for i, t in enumerate(keys) if t == key), default=0)


def _tops(logits: torch.Tensor, sb: SamplingBatch,
          seqs: list[_Seq]) -> list[dict[int, float] | None] | None:
    """The top log-probs of the rows whose request asks for them; None if none does."""
    ks = [s.req.sampling.top_logprobs for s in seqs]
    return top_logprobs(logits, sb, ks) if any(ks) else None


def _draws(sb: SamplingBatch, seqs: list[_Seq]) -> torch.Tensor | None:
    """The draw number of each row's next token (its tokens so far), where a request seeds
    its own random stream (`SamplingParams.seed`)."""
    if not sb.any_seeded:
        return None
    return torch.tensor([len(s.output_ids) for s in seqs], dtype=torch.long)


@contextlib.contextmanager
def _single_threaded():
    """Run torch ops of the calling thread on one thread (no OpenMP team of its own)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _shared_prefixes(prompts: list[list[int]], min_shared: int | Sequence[int],
                     cached: Sequence[list[int]] = ()) -> tuple[list[int], list[int]]:
    """Where each prompt can take the keys and values of a prefix from, and how many.

    Prompts and `cached` are keys (token ids, or any ints: `_Seq.keys`). Candidates are
    `cached` (already in the cache), then `prompts` in order, where only prompts that take
    nothing from an earlier prompt count (they are computed in full first). Per prompt:
    the candidate's index in cached + prompts with the longest common prefix, or -1, and
    the number of keys to take: at least `min_shared` (one for all, or one per prompt),
    and never the prompt's last token (whose logits it needs).
    """
    donor, shared = [-1] * len(prompts), [0] * len(prompts)
    if isinstance(min_shared, int):
        min_shared = [min_shared] * len(prompts)
    seqs = list(cached) + list(prompts)
    if len(seqs) < 2:
        return donor, shared
    width = max(map(len, seqs)) + 1
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    valid = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, p in enumerate(seqs):
        ids[i, :len(p)] = torch.tensor(p, dtype=torch.long)
        valid[i, :len(p)] = True
    # common[i][j]: length of the common prefix of seqs i and j (padding never matches, and
    # the extra padding column ends every run)
    eq = (ids[:, None, :] == ids[None, :, :]) & valid[:, None, :] & valid[None, :, :]
    common = eq.cumprod(-1).sum(-1).tolist()
    sources = list(range(len(cached)))
    for i in range(len(prompts)):
        row = len(cached) + i
        best, best_len = -1, 0
        for j in sources:
            if common[row][j] > best_len:
                best, best_len = j, common[row][j]
        best_len = min(best_len, len(prompts[i]) - 1)
        if best_len >= min_shared[i]:
            donor[i], shared[i] = best, best_len
        if best < len(cached) or best_len < min_shared[i]:  # computed in full (past the prefix)
            sources.append(row)
    return donor, shared
