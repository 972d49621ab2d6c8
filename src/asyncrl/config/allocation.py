"""AReaL-style layouts: which inference backend, how many servers and GPUs each, how many
trainer ranks in which mesh, and whether servers and ranks share GPUs.

Two spellings, which AReaL both accepts:
- `allocation_mode: <backend>:d<N>[t<T>][e<F>]<op>[fsdp:]d<M>[t<S>|e<E>]`, e.g.
  `vllm:d2+fsdp:d1`, `sglang:d2t4+fsdp:d2t2`, `local:d1|fsdp:d1`, `vllm:d1t2e2+fsdp:d1e2`;
- per engine, `rollout.backend: <backend>:d<N>[t<T>][e<F>]` and
  `actor.backend: fsdp:d<M>[t<S>|e<E>]`.
N inference servers of T GPUs each (tensor parallel inside a server: vLLM's
--tensor-parallel-size, SGLang's --tp-size); F > 1 splits a Mixture-of-Experts model's
experts over F of those T GPUs (vLLM's --enable-expert-parallel, whose expert group is the
server's T workers, so F = T there; SGLang's --ep-size F, F dividing T). Trainer ranks:
M x S in a (data, tensor) mesh, S ranks splitting each layer's matmuls
(`trainer/parallel.py`) and M such groups splitting the batch; or M x E in a (data, expert)
mesh, every rank taking its own rows and each of E ranks holding 1/E of every MoE layer's
experts (`trainer/experts.py`). Tensor and expert parallel training do not combine (t or e).
The dimensions may come in any order (`t2d4` is `d4t2`); a missing one is 1.
The operator is AReaL's:
- `+` separate GPUs: the servers take N x T GPUs and the trainer ranks M x S others;
- `|` colocated: the servers and the trainer ranks take the same GPUs (N x T must equal
  M x S), each with its share of the GPU's memory (`rollout.gpu_memory_fraction`). This is
  how one GPU runs a whole RL run: `local:d1|fsdp:d1` or `vllm:d1|fsdp:d1` with
  `cluster.n_gpus_per_node=1`.
On a CPU machine both mean the same: every process shares the machine's cores.
Pipeline parallelism is not supported, so p may only be 1.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

BACKENDS = ("local", "vllm", "sglang")
_DIMS = re.compile(r"^(?:[dtpe]\d+)+$")
_FORM = "'<backend>:d<N>+fsdp:d<M>' (separate GPUs) or '<backend>:d<N>|fsdp:d<N>' (shared)"


@dataclass(frozen=True)
class Allocation:
    backend: str
    n_servers: int
    trainer_world_size: int  # every trainer rank: data x tensor x expert
    colocated: bool = False  # `|`: servers and trainer ranks on the same GPUs
    server_tensor_size: int = 1  # GPUs (tensor-parallel workers) of one server
    trainer_tensor_size: int = 1  # trainer ranks that split each layer
    server_expert_size: int = 1  # GPUs of one server that split the experts
    trainer_expert_size: int = 1  # trainer ranks that split the experts

    @property
    def n_gpus(self) -> int:
        """GPUs the allocation takes: the servers' and the ranks', or one set shared."""
        if self.colocated:
            return self.trainer_world_size
        return self.server_gpus + self.trainer_world_size

    @property
    def server_gpus(self) -> int:
        """GPUs of all the servers together."""
        return self.n_servers * self.server_tensor_size

    @property
    def trainer_data_size(self) -> int:
        """Data-parallel groups of trainer ranks (the d of the training part)."""
        return self.trainer_world_size // (self.trainer_tensor_size * self.trainer_expert_size)

    @property
    def rollout_part(self) -> str:
        """The inference part, canonical: `vllm:d2`, `vllm:d2t4` or `vllm:d1t2e2`."""
        layout = _spell(self.n_servers, self.server_tensor_size, self.server_expert_size)
        return f"{self.backend}:{layout}"

    @property
    def train_part(self) -> str:
        """The training part, canonical: `fsdp:d2`, `fsdp:d2t2` or `fsdp:d2e2` (actor.backend's
        form)."""
        layout = _spell(self.trainer_data_size, self.trainer_tensor_size,
                        self.trainer_expert_size)
        return f"fsdp:{layout}"

    @property
    def mode(self) -> str:
        """The whole allocation as a canonical allocation_mode."""
        return f"{self.rollout_part}{'|' if self.colocated else '+'}{self.train_part}"


def _spell(d: int, t: int, e: int = 1) -> str:
    return f"d{d}" + (f"t{t}" if t > 1 else "") + (f"e{e}" if e > 1 else "")


def _dims(text: str, where: str, example: str) -> dict[str, int]:
    """{'d': N, 't': T, 'p': P} of e.g. "d2t4" (missing ones 1); ValueError naming `where`."""
    if not _DIMS.match(text):
        raise ValueError(f"{where}: {text!r} is not a layout like {example!r} (d<N> data "
                         "parallel, optionally t<T> tensor and e<E> expert parallel)")
    found = re.findall(r"([dtpe])(\d+)", text)
    letters = [letter for letter, _ in found]
    for letter in set(letters):
        if letters.count(letter) > 1:
            raise ValueError(f"{where}: {text!r} gives {letter} more than once")
    dims = {"d": 1, "t": 1, "p": 1, "e": 1} | {letter: int(n) for letter, n in found}
    if "d" not in letters:
        raise ValueError(f"{where}: {text!r} has no d<N> (how many data-parallel copies); "
                         f"e.g. {example!r}")
    for letter, n in dims.items():
        if n < 1:
            raise ValueError(f"{where}: {letter} must be >= 1, got {letter}{n} in {text!r}")
    if dims["p"] != 1:
        raise ValueError(f"{where}: pipeline parallelism (p{dims['p']}) is not supported; "
                         "use p1 or drop it")
    return dims


class RolloutLayout(NamedTuple):
    backend: str
    servers: int | None  # None: not given (rollout.n_servers or 1)
    tensor: int = 1
    expert: int = 1


class TrainLayout(NamedTuple):
    data: int
    tensor: int = 1
    expert: int = 1

    @property
    def world_size(self) -> int:
        return self.data * self.tensor * self.expert

    @property
    def spelling(self) -> str:
        """actor.backend's canonical form: `fsdp:d2`, `fsdp:d2t2` or `fsdp:d2e4`."""
        return f"fsdp:{_spell(*self)}"


def parse_rollout_backend(text: str, key: str = "rollout.backend") -> RolloutLayout:
    """(backend, servers or None, tensor size, expert size) of "vllm", "vllm:d2t4" or
    "vllm:d1t2e2"; ValueError naming `key`."""
    return _rollout(text, f"{key}={text!r}")


def parse_train_backend(text: str, key: str = "actor.backend") -> TrainLayout:
    """(data, tensor, expert size) of "fsdp:d2t2", "fsdp:d2e2" (or "d2t2"); ValueError
    naming `key`."""
    return _train(text, f"{key}={text!r}")


def _rollout(text: str, where: str) -> RolloutLayout:
    name, _, layout = text.replace(" ", "").partition(":")
    if name not in BACKENDS:
        raise ValueError(f"{where}: backend {name!r} is not one of {list(BACKENDS)}")
    if not layout:
        return RolloutLayout(name, None)
    dims = _dims(layout, where, "d2t4")
    t, e = dims["t"], dims["e"]
    if e > 1 and name == "local":
        raise ValueError(f"{where}: our local engine runs a Mixture-of-Experts model in one "
                         f"process; e{e} (expert parallel) is for vllm or sglang, use e1")
    if e > 1 and name == "vllm" and e != t:
        raise ValueError(f"{where}: vLLM's expert parallelism splits the experts over all "
                         f"the server's t{t} tensor-parallel GPUs; use e{t} (or e1)")
    if t % e:
        raise ValueError(f"{where}: e{e} GPUs split the experts among the server's t{t} "
                         "GPUs, so e must divide t (SGLang's --ep-size within --tp-size)")
    return RolloutLayout(name, dims["d"], t, e)


def _train(text: str, where: str) -> TrainLayout:
    engine, _, layout = text.replace(" ", "").rpartition(":")
    if engine not in ("", "fsdp"):
        raise ValueError(f"{where}: training engine {engine!r} is not supported; use fsdp, "
                         "e.g. 'fsdp:d2t2'")
    dims = _dims(layout, where, "fsdp:d2t2")
    if dims["t"] > 1 and dims["e"] > 1:
        raise ValueError(f"{where}: tensor (t{dims['t']}) and expert (e{dims['e']}) parallel "
                         "training together are not supported; use one of them, e.g. "
                         f"'fsdp:d{dims['d']}e{dims['e']}' or 'fsdp:d{dims['d']}t{dims['t']}'")
    return TrainLayout(dims["d"], dims["t"], dims["e"])


def check_expert_split(num_experts: int, expert: int, kind: str) -> None:
    """Raise, naming the sizes, unless `expert` ranks (actor.backend's e) can split a model's
    `num_experts` experts per MoE layer evenly (0: a dense model, `kind` its model_type).
    The trainer (trainer/experts.py) and `asyncrl plan` both ask this."""
    if expert == 1:
        return
    if not num_experts:
        raise ValueError(f"expert parallel training (e{expert} in actor.backend) splits the "
                         f"experts of a Mixture-of-Experts model, and {kind} has none; use "
                         "e1 (data parallel: fsdp:d<N>)")
    if num_experts % expert:
        fits = [e for e in range(1, num_experts + 1) if num_experts % e == 0]
        raise ValueError(f"expert parallel size e{expert} (actor.backend) must divide the "
                         f"model's num_experts={num_experts}: each rank holds an equal share; "
                         f"use e in {fits}")


# The HF model types whose decoder layers tensor parallel training splits
# (trainer/parallel.py's layer plan knows their module names and head layout).
TENSOR_PARALLEL_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def check_tensor_split(model_type: str, sizes: dict[str, int], tensor: int) -> None:
    """Raise, naming the sizes, unless `tensor` ranks (actor.backend's t) can split a model of
    `model_type` whose `sizes` are its num_attention_heads, num_key_value_heads and
    intermediate_size. The trainer (trainer/parallel.py) and `asyncrl plan` both ask this."""
    if tensor == 1:
        return
    if model_type not in TENSOR_PARALLEL_MODEL_TYPES:
        raise ValueError(f"tensor parallel training (t{tensor}) knows the decoder layers of "
                         f"{list(TENSOR_PARALLEL_MODEL_TYPES)}, not model_type {model_type!r}; "
                         "use t1 in actor.backend")
    bad = {name: n for name, n in sizes.items() if n % tensor}
    if bad:
        fits = [t for t in range(1, tensor + 1) if all(n % t == 0 for n in sizes.values())]
        raise ValueError(
            f"tensor parallel size t{tensor} (actor.backend) must divide the model's "
            f"{', '.join(f'{k}={v}' for k, v in bad.items())}: each rank takes whole heads "
            f"and an equal slice of the MLP; use t in {fits}")


def check_lora_layout(layout: TrainLayout, backend: str | None) -> None:
    """Raise unless LoRA can train on `layout`: data parallel only (the trainer and `asyncrl
    plan` both ask this)."""
    if layout.tensor > 1 or layout.expert > 1:
        raise ValueError(f"actor.use_lora=true with actor.backend={backend!r} (tensor or "
                         "expert parallel) is not supported: use fsdp:d<N> (data parallel) "
                         "with LoRA")


def parse_allocation_mode(mode: str) -> Allocation:
    """Parse e.g. "vllm:d2+fsdp:d1", "sglang:d2t4+fsdp:d2t2" or "local:d1|fsdp:d1";
    ValueError naming the bad part."""
    text = mode.replace(" ", "")
    n_plus, n_bar = text.count("+"), text.count("|")
    if n_plus + n_bar != 1:
        raise ValueError(f"allocation_mode {mode!r} must be {_FORM}: one '+' or '|' between "
                         "the inference and the training part, e.g. 'vllm:d2+fsdp:d1'")
    colocated = n_bar == 1
    gen, train = text.split("|" if colocated else "+")
    if ":" not in gen:
        raise ValueError(f"allocation_mode {mode!r}: inference part {gen!r} is not "
                         f"'<backend>:d<N>' with backend one of {list(BACKENDS)}")
    where = f"allocation_mode {mode!r}"
    backend, n_servers, server_tp, server_ep = _rollout(gen, f"{where}: inference part {gen!r}")
    trainer = _train(train, f"{where}: training part {train!r}")
    alloc = Allocation(backend, n_servers or 1, trainer.world_size, colocated, server_tp,
                       trainer.tensor, server_ep, trainer.expert)
    if colocated and alloc.server_gpus != alloc.trainer_world_size:
        raise ValueError(
            f"{where}: '|' puts the servers and the trainer ranks on the same GPUs, so both "
            f"sides need as many (here {alloc.server_gpus} for the servers and "
            f"{alloc.trainer_world_size} for the ranks); e.g. "
            f"'{backend}:{_spell(alloc.trainer_world_size // server_tp, server_tp, server_ep)}|"
            f"{alloc.train_part}', or '+' for separate GPUs")
    return alloc
