"""Configs of the offline trainers (SFT, DPO, reward model): fixed rows, no rollouts.

They share `OfflineConfig`; DPO and the reward model share `PreferenceConfig` too (pair
rows, kept in one micro-batch). Keys keep AReaL's names where AReaL has them (`model` is
its TrainEngineConfig section, `total_train_epochs`, `train_dataset.batch_size`, ...) and
TRL's for DPO (`beta`, `loss_type`, `label_smoothing`). Load one with
`load_config(path, overrides, schema=SFTConfig)`.

`allocation_mode` is AReaL's training part alone, `fsdp:d<N>`: N data-parallel ranks on
this machine, which `asyncrl sft | dpo | rm` starts (offline/launch.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional

from asyncrl.config.algorithm import _check_lora_keys
from asyncrl.config.engine import TrainEngineSpec
from asyncrl.config.schema import (
    ClusterConfig,
    MicroBatchSpec,
    OptimizerConfig,
    RefConfig,
    SaverConfig,
    StatsLoggerConfig,
    _check,
)

SFT_FORMATS = ("auto", "prompt_answer", "chat", "gsm8k")
PREFERENCE_FORMATS = ("auto", "preference")
DPO_LOSS_TYPES = ("sigmoid", "ipo")
_RANKS = re.compile(r"^(?:fsdp:)?d(?P<n>\d+)$")  # allocation_mode's training part


@dataclass(kw_only=True)
class TrainEngineConfig:
    """The trained model: what `FSDPTrainEngine` needs, without the RL actor's keys."""

    path: str = "smollm2-135m-instruct"  # HF folder, HF hub id, or a named small model
    # Train from random weights of path's architecture (seeded by `seed`) instead of path's.
    init_from_scratch: bool = False
    dtype: Literal["bfloat16", "float32"] = "bfloat16"  # compute dtype; master weights fp32
    # Recompute activations in the backward pass instead of keeping them (HF gradient
    # checkpointing, non-reentrant): less memory, more compute.
    gradient_checkpointing: bool = False
    # How each batch is cut into forward/backward micro-batches (DPO and RM keep a pair in one).
    mb_spec: MicroBatchSpec = field(default_factory=MicroBatchSpec)
    # The model's AdamW and lr schedule.
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-5))
    # Rows sharing a prefix (DPO's chosen and rejected share their prompt) run it once, as
    # a token trie (trainer/prefix.py); exact. Needs sdpa attention.
    shared_prefix: bool = False
    # LoRA (the RL actor's keys): train low-rank adapters W + (lora_alpha / lora_rank) B A
    # on the target_modules' weights (PEFT, trainer/lora.py) with the base frozen; the saved
    # HF folders are adapter folders (`asyncrl export-merged` writes a merged model). SFT
    # and DPO only. Needs `pip install 'asyncrl[lora]'`.
    use_lora: bool = False
    lora_rank: int = 32  # r, the adapters' inner dimension
    lora_alpha: int = 16  # the adapters' output is scaled by lora_alpha / lora_rank
    # Module names to adapt (q_proj, v_proj, ...) or "all-linear": every linear layer of the
    # decoder, not the output projection.
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    peft_type: str = "lora"  # the PEFT method; only "lora" is supported
    # Parameter-name prefixes to keep fixed: they take no gradients and no optimiser state,
    # and the saved folder holds them unchanged. A vision-language model's warm start may
    # train its vision encoder and connector alone: ["model.text_model"] (a tied head is the
    # embedding; add "lm_head" where the head is a tensor of its own).
    frozen_modules: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_lora_keys(self, "model")
        _check(not (self.use_lora and self.frozen_modules),
               "model.frozen_modules with model.use_lora: LoRA already freezes the base; drop "
               "one of them")

    def engine_spec(self, *, device: str) -> TrainEngineSpec:
        """What `FSDPTrainEngine` reads of this section, its ranks on `device`."""
        return TrainEngineSpec.of(self, device=device)


@dataclass(kw_only=True)
class OfflineDatasetConfig:
    # A JSONL file, or a folder holding <split>.jsonl (or <split>-*.jsonl shards).
    path: str = ""
    split: str = "train"  # for folders
    # The row shape. auto: from each row's keys. prompt_answer: {"prompt", "answer" or
    # "completion"}. chat: {"messages": [{"role", "content"}, ...]} (loss on assistant turns).
    # gsm8k: {"question", "answer"} (the answer is the whole solution). preference (DPO,
    # RM): {"prompt", "chosen", "rejected"}, each a string or a list of chat messages, or
    # {"chosen", "rejected"} as whole conversations (TRL's implicit prompt).
    format: Literal["auto", "prompt_answer", "chat", "gsm8k", "preference"] = "auto"
    batch_size: int = 8  # examples (SFT rows, DPO/RM pairs) per optimiser step or eval forward
    shuffle: bool = True  # reshuffled every epoch from (seed, epoch)
    # Examples with a row longer than this many tokens (prompt + answer) are dropped.
    max_length: Optional[int] = None
    size: Optional[int] = None  # keep the first `size` rows of the file
    # Malformed rows (bad JSON, a wrong shape): skip them with one warning that counts them
    # and names the first by file and line, or stop at the first ("error").
    bad_rows: Literal["skip", "error"] = "skip"

    def check(self, name: str) -> None:
        """Raise naming `<name>.<key>` if a value is out of range."""
        _check(bool(self.path), f"{name}.path is empty: give a JSONL file or a folder holding "
               f"<split>.jsonl")
        _check(self.batch_size >= 1, f"{name}.batch_size must be >= 1, got {self.batch_size}")
        _check(self.size is None or self.size >= 1,
               f"{name}.size must be >= 1 or null (all rows), got {self.size}")
        _check(self.max_length is None or self.max_length >= 2,
               f"{name}.max_length must be >= 2 tokens or null, got {self.max_length}")


@dataclass(kw_only=True)
class OfflineEvaluatorConfig:
    """Held-out loss (and the trainer's metrics) on valid_dataset: before, every N, after."""

    # Evaluate every this many training steps.
    freq_steps: Optional[int] = None
    # Evaluate every this many epochs (passes over train_dataset).
    freq_epochs: Optional[int] = None
    # Evaluate at the end of the first step this many seconds after the last evaluation (or
    # the start).
    freq_secs: Optional[float] = None
    # Evaluate the starting weights first.
    before_training: bool = True
    # Evaluate the final weights after the last step.
    after_training: bool = True


def offline_world_size(mode: str) -> int:
    """The trainer ranks of an offline `allocation_mode` ("fsdp:d<N>"); ValueError otherwise."""
    parts = mode.replace(" ", "").split("+")
    if len(parts) > 1:
        raise ValueError(f"allocation_mode={mode!r} has an inference part ({parts[0]!r}), but "
                         f"offline training (sft, dpo, rm) starts no inference servers; give the "
                         f"training part alone, e.g. allocation_mode={parts[-1]}")
    m = _RANKS.match(parts[0])
    if m is None or int(m["n"]) < 1:
        raise ValueError(f"allocation_mode={mode!r} is not 'fsdp:d<N>' (N >= 1 data-parallel "
                         f"trainer ranks), e.g. allocation_mode=fsdp:d8")
    return int(m["n"])


@dataclass(kw_only=True)
class OfflineSchedulerConfig:
    # Who starts allocation_mode's ranks: local processes on this machine. ray and slurm
    # (the RL run's) are refused with what to do instead.
    type: Literal["local", "ray", "slurm"] = "local"
    # CPU threads of each trainer rank. null: torch's default for one rank; the machine's
    # cores split evenly (and pinned) between the ranks `asyncrl` starts for allocation_mode.
    trainer_threads: Optional[int] = None


@dataclass(kw_only=True)
class OfflineConfig:
    """What every offline trainer reads; SFTConfig, DPOConfig and RMConfig add their own."""

    # The folder of this experiment's runs, <cluster.fileroot>/<experiment_name>/ (each trainer
    # has its own default), and the trackers' default project.
    experiment_name: str = "asyncrl-offline"
    # This run's folder in it, <cluster.fileroot>/<experiment_name>/<trial_name>/, and the
    # trackers' default run name.
    trial_name: str = "trial0"
    seed: int = 1  # weights of init_from_scratch models and the shuffling of the data
    # Passes over train_dataset, of ceil(examples / train_dataset.batch_size) steps each; the
    # run stops after them or after total_train_steps, whichever comes first.
    total_train_epochs: int = 1
    total_train_steps: Optional[int] = None  # stop earlier than the epochs allow
    # The tokenizer of the rows; default: the model's.
    tokenizer_path: str = "${model.path}"
    # A system turn put before prompts given as plain strings (not before chat rows).
    system_prompt: Optional[str] = None
    # AReaL's "fsdp:d<N>" (the training part only: offline runs have no inference servers).
    # N > 1: `asyncrl sft|dpo|rm` starts N data-parallel ranks (one GPU each when
    # cluster.n_gpus_per_node > 0) and waits for them. null: one rank, or as many as
    # torchrun starts.
    allocation_mode: Optional[str] = None
    # This machine (n_nodes must be 1): its GPUs (one per rank; 0: the CPU) and where runs
    # are written.
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    # How allocation_mode's ranks are started, and their CPU threads.
    scheduler: OfflineSchedulerConfig = field(default_factory=OfflineSchedulerConfig)
    model: TrainEngineConfig = field(default_factory=TrainEngineConfig)
    # The rows trained on (train_dataset.path is required).
    train_dataset: OfflineDatasetConfig = field(default_factory=OfflineDatasetConfig)
    # Held-out rows whose loss the evaluator reports; null: none.
    valid_dataset: Optional[OfflineDatasetConfig] = None
    saver: SaverConfig = field(default_factory=SaverConfig)  # the final model is always saved
    evaluator: OfflineEvaluatorConfig = field(default_factory=OfflineEvaluatorConfig)
    # Where each step's stats go (rank 0 writes them): <run>/stats.jsonl, TensorBoard, the
    # progress bar, trackers.
    stats_logger: StatsLoggerConfig = field(default_factory=StatsLoggerConfig)

    def __post_init__(self) -> None:
        _check(self.total_train_epochs >= 1,
               f"total_train_epochs must be >= 1, got {self.total_train_epochs}")
        _check(self.total_train_steps is None or self.total_train_steps >= 1,
               f"total_train_steps must be >= 1 or null, got {self.total_train_steps}")
        _check(self.scheduler.trainer_threads is None or self.scheduler.trainer_threads >= 1,
               f"scheduler.trainer_threads must be >= 1 or null, got "
               f"{self.scheduler.trainer_threads}")
        self.train_dataset.check("train_dataset")
        if self.valid_dataset is not None:
            self.valid_dataset.check("valid_dataset")
        self._check_allocation()
        self._check_formats()

    @property
    def trainer_world_size(self) -> int:
        """Trainer ranks: allocation_mode's fsdp:d<N>, else 1."""
        return 1 if self.allocation_mode is None else offline_world_size(self.allocation_mode)

    def _check_allocation(self) -> None:
        """The ranks run on this machine, under the local scheduler, one GPU each on GPUs."""
        _check(self.scheduler.type == "local",
               f"scheduler.type={self.scheduler.type}: offline training starts its "
               f"allocation_mode ranks as local processes on one machine; set "
               f"scheduler.type=local (on several nodes, start the ranks with torchrun)")
        _check(self.cluster.n_nodes == 1,
               f"cluster.n_nodes={self.cluster.n_nodes}: offline training starts its "
               f"allocation_mode ranks on this machine only; set cluster.n_nodes=1 (on several "
               f"nodes, start the ranks with torchrun)")
        world = self.trainer_world_size  # raises, naming allocation_mode, if malformed
        gpus = self.cluster.n_gpus_per_node
        _check(gpus == 0 or world <= gpus,
               f"allocation_mode={self.allocation_mode!r} needs {world} GPUs (one per rank) but "
               f"cluster.n_gpus_per_node={gpus}; lower fsdp:d<N> or raise n_gpus_per_node")
        for name, ds in self._datasets():
            _check(ds.batch_size >= world,
                   f"{name}.batch_size={ds.batch_size} is smaller than the {world} ranks of "
                   f"allocation_mode={self.allocation_mode!r}, and every rank needs an example "
                   f"of each batch; raise {name}.batch_size or lower fsdp:d<N>")

    def _check_formats(self) -> None:
        """Hook for a trainer's accepted row formats."""

    def _datasets(self) -> list[tuple[str, OfflineDatasetConfig]]:
        named = [("train_dataset", self.train_dataset), ("valid_dataset", self.valid_dataset)]
        return [(name, ds) for name, ds in named if ds is not None]


@dataclass(kw_only=True)
class SFTConfig(OfflineConfig):
    """Supervised fine-tuning: -mean log p over answer (assistant) tokens."""

    experiment_name: str = "asyncrl-sft"

    def _check_formats(self) -> None:
        for name, ds in self._datasets():
            _check(ds.format in SFT_FORMATS,
                   f"{name}.format={ds.format} is not an SFT format; use one of {SFT_FORMATS} "
                   f"(preference rows are for `asyncrl dpo` or `asyncrl rm`)")


@dataclass(kw_only=True)
class PreferenceConfig(OfflineConfig):
    """What DPO and reward-model training share: (chosen, rejected) rows, one micro-batch."""

    TRAINER: ClassVar[str] = "preference"  # names the trainer in errors

    def __post_init__(self) -> None:
        super().__post_init__()
        # A pair's loss needs both rows in one micro-batch: the planner keeps units of
        # `granularity` consecutive rows (chosen, rejected) together.
        spec = self.model.mb_spec
        if spec.granularity == 1:
            spec.granularity = 2
        _check(spec.granularity % 2 == 0,
               f"model.mb_spec.granularity={spec.granularity} would split (chosen, rejected) "
               f"pairs across micro-batches; drop it ({self.TRAINER} training sets 2) or make "
               f"it even")

    def _check_formats(self) -> None:
        for name, ds in self._datasets():
            _check(ds.format in PREFERENCE_FORMATS,
                   f"{name}.format={ds.format} is not a {self.TRAINER} format; use one of "
                   f"{PREFERENCE_FORMATS}")


@dataclass(kw_only=True)
class DPOConfig(PreferenceConfig):
    """Direct preference optimisation on (prompt, chosen, rejected) rows."""

    TRAINER: ClassVar[str] = "DPO"
    experiment_name: str = "asyncrl-dpo"
    # The frozen reference policy; its log-probs are computed once per dataset, then it is
    # freed. Defaults to the model's starting weights at the model's dtype.
    ref: RefConfig = field(
        default_factory=lambda: RefConfig(path="${model.path}", dtype="${model.dtype}"))
    beta: float = 0.1  # the KL strength: the implicit reward is beta * log(p / p_ref)
    # sigmoid: -log sigmoid(beta * h) (DPO). ipo: (h - 1 / (2 beta))^2 (IPO), where h is the
    # chosen-minus-rejected difference of sequence log-ratios to the reference.
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    # cDPO: the preference label is flipped with this probability (sigmoid loss only).
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.beta > 0, f"beta must be > 0, got {self.beta}")
        _check(self.loss_type in DPO_LOSS_TYPES,
               f"loss_type must be one of {DPO_LOSS_TYPES}, got {self.loss_type!r}")
        _check(0 <= self.label_smoothing < 0.5,
               f"label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        _check(self.label_smoothing == 0 or self.loss_type == "sigmoid",
               f"label_smoothing={self.label_smoothing} applies to loss_type=sigmoid only; "
               f"set label_smoothing=0 for loss_type={self.loss_type}")


@dataclass(kw_only=True)
class RMConfig(PreferenceConfig):
    """Reward-model training: -log sigmoid(r_chosen - r_rejected), mean over pairs.

    `model.path`'s decoder gets a fresh scalar head (seeded by `seed`). `system_prompt` is
    saved in the model's config, so RL scoring renders completions as training did.
    """

    TRAINER: ClassVar[str] = "reward-model"
    experiment_name: str = "asyncrl-rm"

    def __post_init__(self) -> None:
        super().__post_init__()
        # The fresh score head would have to train whole beside the adapters and be saved
        # with them, which the adapter folder (LoRA factors only) does not hold.
        _check(not self.model.use_lora,
               "model.use_lora=true: reward-model training does not take LoRA adapters yet "
               "(its new score head trains whole); set model.use_lora=false")


TRAINER_SCHEMAS = {"sft": SFTConfig, "dpo": DPOConfig, "rm": RMConfig}
