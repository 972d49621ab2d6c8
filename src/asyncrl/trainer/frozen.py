"""Frozen models that score the actor's batches: the KL reference and the distillation teacher.

Each is an `FSDPTrainEngine` that is never stepped: AdamW allocates its state on the first
step, so its unused optimiser costs no memory. It shares the actor's temperature, so its
log-probs are of the same tempered distribution as the actor's.
"""

from __future__ import annotations

from typing import Any

from asyncrl.config.engine import TrainEngineSpec
from asyncrl.config.schema import ActorConfig, MicroBatchSpec, RefConfig, TeacherConfig
from asyncrl.trainer.engine import FSDPTrainEngine


def frozen_engine(*, path: str, dtype: str, mb_spec: MicroBatchSpec, seed: int, device: str,
                  temperature: float = 1.0, init_from_scratch: bool = False,
                  shared_prefix: bool = False) -> FSDPTrainEngine:
    """A never-stepped engine for the model at `path` on `device` (not initialised)."""
    spec = TrainEngineSpec(path=path, dtype=dtype, mb_spec=mb_spec, temperature=temperature,
                           init_from_scratch=init_from_scratch, shared_prefix=shared_prefix,
                           device=device)
    return FSDPTrainEngine(spec, total_steps=1, seed=seed)


class LoraBase:
    """The KL reference of a LoRA actor whose base is the reference model: the actor's own
    model with its adapters switched off. No second copy of the weights is loaded; its
    log-probs are computed in the actor's dtype and micro-batches."""

    def __init__(self, actor: FSDPTrainEngine) -> None:
        self.actor = actor

    def initialize(self) -> None:
        """Nothing to load: the actor holds the base."""

    def destroy(self) -> None:
        """Nothing to free: the actor owns the model."""

    def compute_logprobs(self, batch: Any) -> Any:
        return self.actor.compute_base_logprobs(batch)


def make_ref_engine(actor: ActorConfig, ref: RefConfig, *, seed: int, device: str,
                    actor_engine: FSDPTrainEngine | None = None
                    ) -> FSDPTrainEngine | LoraBase | None:
    """The frozen reference model of the KL term (not initialised); None when kl_ctl is 0.

    It shares the actor's init_from_scratch (with the same seed: the same weights). With
    actor.use_lora and ref.path the actor's, it is `actor` with its adapters off.
    """
    if actor.kl_ctl == 0:
        return None
    if actor.use_lora and ref.path == actor.path:
        if actor_engine is None:
            raise ValueError("make_ref_engine: a LoRA actor's reference is the actor itself; "
                             "pass actor_engine=")
        return LoraBase(actor_engine)
    return frozen_engine(path=ref.path, dtype=ref.dtype, mb_spec=ref.mb_spec, seed=seed,
                         device=device, temperature=actor.temperature,
                         init_from_scratch=actor.init_from_scratch,
                         shared_prefix=actor.shared_prefix)


def make_teacher_engine(actor: ActorConfig, teacher: TeacherConfig, *, seed: int,
                        device: str) -> FSDPTrainEngine | None:
    """The distillation teacher (not initialised); None when actor.distill_coef is 0."""
    if actor.distill_coef == 0:
        return None
    return frozen_engine(path=teacher.path, dtype=teacher.dtype, mb_spec=teacher.mb_spec,
                         seed=seed, device=device, temperature=actor.temperature,
                         shared_prefix=actor.shared_prefix)


def check_shared_vocab(student_vocab: dict[str, int], teacher_vocab: dict[str, int],
                       teacher_rows: int, *, teacher_path: str) -> None:
    """Raise unless the teacher reads the student's token ids as the same tokens.

    The teacher scores the actor's token ids, so both tokenizers must map every token to the
    same id, and the teacher's output layer must have a row for every id. Padded rows beyond
    the tokenizer (model sizes of one family differ there) are harmless.
    """
    where = f"teacher.path={teacher_path!r}"
    if len(teacher_vocab) != len(student_vocab):
        raise ValueError(f"{where} has a tokenizer of {len(teacher_vocab)} tokens but the actor's "
                         f"(tokenizer_path) has {len(student_vocab)}: the teacher scores the "
                         "actor's token ids, so it must share the actor's tokenizer; choose a "
                         "teacher of the same model family")
    differ = sorted((i, tok) for tok, i in student_vocab.items() if teacher_vocab.get(tok) != i)
    if differ:
        i, tok = differ[0]
        raise ValueError(f"{where}: {len(differ)} of {len(student_vocab)} tokens have other ids "
                         f"than in the actor's tokenizer (e.g. {tok!r}: {i} for the actor, "
                         f"{teacher_vocab.get(tok)} for the teacher); use a teacher that shares "
                         "the actor's tokenizer")
    if teacher_rows < len(student_vocab):
        raise ValueError(f"{where}: its output layer has {teacher_rows} rows (config vocab_size) "
                         f"but the tokenizer has {len(student_vocab)} tokens, so some token ids "
                         "have no log-prob; the teacher's checkpoint does not match its tokenizer")


def check_teacher_vocab(student_tokenizer: Any, teacher: FSDPTrainEngine) -> None:
    """`check_shared_vocab` on an initialised teacher engine."""
    check_shared_vocab(student_tokenizer.get_vocab(), teacher.tokenizer.get_vocab(),
                       teacher.model.hf.config.vocab_size, teacher_path=teacher.spec.path)
