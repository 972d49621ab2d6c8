"""The RL algorithm's sections: the actor (policy loss, rewards, advantages, KL,
distillation) and the models beside it (reference, critic, teacher).

Each key is documented where it is declared; docs/guides/algorithms.md has the formulas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from asyncrl.config.allocation import parse_train_backend
from asyncrl.config.engine import MicroBatchSpec, OptimizerConfig, _check

NormLevel = Literal["batch", "group", "none"]


@dataclass(kw_only=True)
class NormConfig:
    """Normalisation of rewards or advantages: subtract a mean, divide by a std."""

    # Subtract the mean of each group (a prompt's samples), of the whole batch, or none.
    mean_level: NormLevel = "group"
    # Divide by the std of each group, of the whole batch, or none (no division); the std is
    # taken around that level's own mean.
    std_level: NormLevel = "group"
    group_size: Optional[int] = None  # samples per group; None: gconfig.n_samples
    # Added to the std before dividing: (x - mean) / (std + eps).
    eps: float = 1e-5
    # RLOO: each sample's mean leaves that sample out, (sum - x_i) / (n - 1).
    mean_leave1out: bool = False
    std_unbiased: bool = False  # variance divides by n - 1 (false: population std, / n)

    def check(self, name: str) -> None:
        """Raise naming `actor.<name>.<key>` if a value is out of range."""
        _check(self.eps >= 0, f"actor.{name}.eps must be >= 0, got {self.eps}")
        _check(self.group_size is None or self.group_size >= 1,
               f"actor.{name}.group_size must be >= 1 or null, got {self.group_size}")
        _check(not (self.mean_leave1out and self.mean_level == "none"),
               f"actor.{name}.mean_leave1out=true has no mean to leave out with "
               f"mean_level=none; set mean_level to group or batch")
        _check(not (self.mean_leave1out and self.mean_level == "group" and self.group_size == 1),
               f"actor.{name}.mean_leave1out=true needs groups of at least 2 samples, but "
               f"group_size=1; raise gconfig.n_samples or set mean_leave1out=false")


@dataclass(kw_only=True)
class RejectionSamplingConfig:
    """Filter on the behaviour importance weight w = proximal / behaviour (AReaL's keys)."""

    # token: each token's w. sequence: one w per sequence, the geometric mean
    # exp(mean log w) over its loss tokens, used as the weight of all its tokens.
    level: Literal["token", "sequence"] = "token"
    # mask: drop tokens (or whole sequences) whose w lies outside [lower, upper].
    # clamp: keep them, with w clipped into [lower, upper].
    action: Literal["mask", "clamp"] = "mask"
    # The upper bound of w; must be > 1 (on-policy tokens have w = 1).
    upper: float = 5.0
    lower: Optional[float] = None  # null: no lower bound

    def check(self) -> None:
        """Raise naming `actor.rejection_sampling.<key>` if a value is out of range."""
        name = "actor.rejection_sampling"
        _check(self.level in ("token", "sequence"),
               f"{name}.level must be one of ('token', 'sequence'), got {self.level!r}")
        _check(self.action in ("mask", "clamp"),
               f"{name}.action must be one of ('mask', 'clamp'), got {self.action!r}")
        # w = 1 on-policy: an upper bound at or below 1 would reject (or bend) fresh samples.
        _check(self.upper > 1, f"{name}.upper must be > 1 (the weight of on-policy tokens is 1), "
               f"got {self.upper}")
        _check(self.lower is None or 0 <= self.lower < 1,
               f"{name}.lower must be in [0, 1) or null, got {self.lower}")


def _check_lora_keys(section: Any, name: str) -> None:
    """Raise naming `<name>.<key>` if a LoRA key of `section` is out of range."""
    _check(section.peft_type == "lora",
           f"{name}.peft_type must be 'lora' (the only PEFT method supported), got "
           f"{section.peft_type!r}")
    _check(section.lora_rank >= 1, f"{name}.lora_rank must be >= 1, got {section.lora_rank}")
    _check(section.lora_alpha > 0, f"{name}.lora_alpha must be > 0, got {section.lora_alpha}")
    modules = section.target_modules
    _check(isinstance(modules, (list, tuple)) and len(modules) > 0
           and all(isinstance(m, str) and m for m in modules),
           f"{name}.target_modules must be a non-empty list of module names (e.g. [q_proj, "
           f"v_proj]) or [all-linear], got {modules!r}")
    _check(not ("all-linear" in modules and len(modules) > 1),
           f"{name}.target_modules={list(modules)}: 'all-linear' already names every linear "
           "layer; give it alone or list the names")
    _check(not (section.use_lora and section.init_from_scratch),
           f"{name}.use_lora=true adapts a pretrained base, but {name}.init_from_scratch=true "
           "would train adapters on random weights the servers do not hold; set one of them "
           "to false")


@dataclass(kw_only=True)
class ActorConfig:
    path: str = "smollm2-135m-instruct"  # HF folder, HF hub id, or a named small model
    # Train from random weights of path's architecture (seeded by `seed`; the reference gets
    # the same) instead of path's weights. The servers start from path's weights until the
    # first publish.
    init_from_scratch: bool = False
    dtype: Literal["bfloat16", "float32"] = "bfloat16"  # compute dtype; master weights fp32
    # The trainer's mesh, AReaL's per-engine spelling: "fsdp:d<M>t<S>", M data-parallel
    # groups of S ranks that split each layer (tensor parallel; trainer/parallel.py), M x S
    # ranks in all; or "fsdp:d<M>e<E>", M x E ranks, each of E holding 1/E of every MoE
    # layer's experts (expert parallel; trainer/experts.py). The training part of
    # allocation_mode, which may only repeat it; null: from allocation_mode, else one rank
    # (filled in when loaded).
    backend: Optional[str] = None
    # Recompute activations in the backward pass instead of keeping them (HF gradient
    # checkpointing, non-reentrant): less memory, more compute.
    gradient_checkpointing: bool = False
    # LoRA (AReaL's keys): train low-rank adapters W + (lora_alpha / lora_rank) B A on the
    # target_modules' weights (PEFT, trainer/lora.py) with the base frozen; each publish
    # and saved HF folder carries the adapters alone (our engine merges them into its base,
    # vLLM and SGLang load them as adapters; `asyncrl export-merged` writes a merged
    # model), and the KL reference is the base (the adapters switched off), not a second
    # copy. Needs `pip install 'asyncrl[lora]'`.
    use_lora: bool = False
    lora_rank: int = 32  # r, the adapters' inner dimension
    lora_alpha: int = 16  # the adapters' output is scaled by lora_alpha / lora_rank
    # Module names to adapt (PEFT's target_modules: names such as q_proj, v_proj, or
    # "all-linear": every linear layer of the decoder, not the output projection).
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    peft_type: str = "lora"  # the PEFT method; only "lora" is supported
    # Parameter-name prefixes to keep fixed: they take no gradients and no optimiser state,
    # and every publish and saved folder holds them unchanged. A vision-language model may
    # train its vision encoder and connector alone (["model.text_model"], plus "lm_head"
    # where the head is not tied), or its language model alone (["model.vision_model",
    # "model.connector"]).
    frozen_modules: list[str] = field(default_factory=list)
    # Compute a prefix that rows share (a GRPO group's prompt, an agent's earlier turns)
    # once per micro-batch, as a token trie with exact gradients (trainer/prefix.py); the
    # reference and teacher log-probs follow this switch. Rows with images share their
    # image tokens only where the pixels are equal too.
    shared_prefix: bool = False
    # Mixture-of-Experts models: add router_aux_loss_coef * the router load-balancing loss
    # (HF's load_balancing_loss_func, over each micro-batch's tokens; the model config's own
    # router_aux_loss_coef is not used). 0: off.
    router_aux_loss_coef: float = 0.0
    # Mixture-of-Experts models: the trainer's forwards route every token to the experts the
    # inference server chose for it during the rollout (prompt tokens included) instead of
    # their own top k, so the trained log-probs score the sampled routing. Needs servers that
    # record them (the local and sglang backends) and shared_prefix=false.
    routing_replay: bool = False
    # How each training batch is cut into forward/backward micro-batches.
    mb_spec: MicroBatchSpec = field(default_factory=MicroBatchSpec)
    # The actor's AdamW and lr schedule (which counts ppo_n_minibatches * ppo_epochs steps per
    # batch).
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    # The temperature the behaviour log-probs were computed at (logits / T).
    temperature: float = 1.0
    eps_clip: float = 0.2  # PPO clip: ratio in [1 - eps_clip, 1 + eps_clip_higher]
    eps_clip_higher: Optional[float] = None  # None: eps_clip (symmetric)
    reward_scaling: float = 1.0  # r <- (r + reward_bias) * reward_scaling
    # Added to each reward before reward_scaling multiplies it (see above).
    reward_bias: float = 0.0
    reward_clip: Optional[float] = None  # clip the shaped reward to [-c, c]; None: no clip
    # DAPO's soft overlong punishment: a completion longer than max_new_tokens - overlong_tokens
    # loses overlong_penalty_factor * (excess / overlong_tokens) of reward (before shaping).
    overlong_reward_penalty: bool = False
    overlong_tokens: Optional[int] = None  # the penalty window; needed when the penalty is on
    # The penalty at the end of the budget: a completion of max_new_tokens tokens loses this.
    overlong_penalty_factor: float = 1.0
    max_new_tokens: Optional[int] = None  # None: gconfig.max_new_tokens (filled when loaded)
    reward_norm: Optional[NormConfig] = field(default_factory=NormConfig)
    adv_norm: Optional[NormConfig] = None
    ppo_n_minibatches: int = 1  # optimiser steps per pass over a training batch
    # Passes over each training batch (verl's name); every pass takes ppo_n_minibatches
    # optimiser steps over the same minibatches in the same order.
    ppo_epochs: int = 1
    # Decoupled PPO: clip policy/proximal, weight by proximal/behaviour (capped).
    use_decoupled_loss: bool = True
    recompute_logprob: bool = True  # the trainer recomputes proximal log-probs
    # Shorthand for rejection_sampling {level: token, action: mask, upper: cap}: tokens whose
    # weight proximal/behaviour exceeds the cap are masked out. null: no filter.
    behav_imp_weight_cap: Optional[float] = 5.0
    # The general filter on that weight (see RejectionSamplingConfig); when set, leave
    # behav_imp_weight_cap null.
    rejection_sampling: Optional[RejectionSamplingConfig] = None
    # Dual-clip PPO: for A < 0 the token loss is at most -A * c_clip. None: off.
    c_clip: Optional[float] = None
    # token-mean: sum over all loss tokens / their count. seq-mean-token-mean: each sequence's
    # mean over its loss tokens, averaged over sequences. seq-mean-token-sum: each sequence's
    # sum over its loss tokens, averaged over sequences. seq-mean-token-sum-norm (Dr.GRPO): that
    # sum divided by the generation budget (max_new_tokens) instead of the sequence's length.
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                           "seq-mean-token-sum-norm"] = "token-mean"
    # token: one ratio per token. sequence (GSPO): exp(mean log-ratio over the sequence's loss
    # tokens), shared by all its tokens and clipped as one.
    importance_sampling_level: Literal["token", "sequence"] = "token"
    # KL to the reference model (`ref`). 0: off, and no reference model is loaded.
    kl_ctl: float = 0.0
    # Per-token estimator of KL(policy || ref) from d = logp - ref_logp: k1 = d,
    # k2 = d^2 / 2, k3 = exp(-d) - 1 + d (Schulman's unbiased, non-negative estimator).
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    # false: KL as a reward penalty, -kl_ctl * kl_t on every completion token after
    # reward_norm, so each token's return counts the KL still to come (AReaL's in-reward KL,
    # REINFORCE++). true: + kl_ctl * agg(kl_t) in the loss (GRPO, verl use_kl_loss), with
    # gradient through the policy log-probs.
    use_kl_loss: bool = False
    # GAE (Schulman et al. 2015): the reward discount gamma and the bias/variance trade-off
    # lambda, over the completion tokens. With a critic, advantages are GAE over its values;
    # without, over values of 0 (gamma = lambda = 1 is the sequence reward on every token).
    discount: float = 1.0
    # GAE's lambda (see discount): 1 is the return minus the value (no bias), 0 the one-step
    # TD error (the value's bias, least variance).
    gae_lambda: float = 1.0
    # Distillation from the `teacher` model on the student's own samples. 0: off, and no
    # teacher is loaded. kl_loss: + distill_coef * agg(k(d)) in the loss, d = logp -
    # teacher_logp, beside the RL objective. on_policy: pure on-policy distillation, the
    # per-token advantage is -distill_coef * (behaviour logp - teacher logp); rewards unused.
    distill_coef: float = 0.0
    # kl_loss or on_policy (see distill_coef): a KL term beside the RL loss, or the teacher's
    # per-token signal as the advantages.
    distill_mode: Literal["kl_loss", "on_policy"] = "kl_loss"
    # The loss term's estimator of KL(student || teacher) from d (as kl_estimator). On the
    # student's samples the gradient of k2 is that of the reverse KL; k3's is the forward
    # KL's; k1's is zero in expectation. Not used by on_policy (its advantage is -k1).
    distill_kl_estimator: Literal["k1", "k2", "k3"] = "k2"
    # How new weights reach the inference servers after each step: disk (a versioned
    # safetensors folder each server reloads), broadcast (a process group of trainer rank
    # 0 and the servers, in buckets of weight_update_bucket_mb MiB; weights/broadcast.py) or
    # ipc (trainer and server on one GPU, allocation_mode '<backend>:d1|fsdp:d1': the
    # server copies the trainer's weights straight from its GPU memory; weights/ipc.py).
    weight_update_mode: Literal["disk", "broadcast", "ipc"] = "disk"
    # broadcast mode: the weights go out in buckets of about this many MiB (a bucket ends with
    # the tensor that passes it). Larger: fewer collective calls, bigger buffers.
    weight_update_bucket_mb: int = 256
    # Disk mode with the trainer inline: the servers load version N while the trainer trains
    # step N + 1; new episodes start under N once every server holds it, and the trainer
    # waits for that load only before its next publish, an evaluation or a recover
    # checkpoint. false: each publish waits for the load (broadcasts and the weight-update
    # service always do: the trainer sends).
    weight_update_overlap: bool = True

    def __post_init__(self) -> None:
        _check(self.temperature > 0, "actor.temperature must be > 0 (use 1.0 when sampling greedily)")
        _check(self.router_aux_loss_coef >= 0,
               f"actor.router_aux_loss_coef must be >= 0 (0 turns it off), got "
               f"{self.router_aux_loss_coef}")
        _check(not (self.routing_replay and self.shared_prefix),
               "actor.routing_replay=true needs each row's own prompt tokens, and "
               "actor.shared_prefix=true shares them between rows; set one of them to false")
        _check(not (self.use_lora and self.frozen_modules),
               "actor.frozen_modules with actor.use_lora: LoRA already freezes the base; drop "
               "one of them")
        if self.backend is not None:
            parse_train_backend(self.backend)  # raises naming actor.backend
        _check(self.weight_update_mode in ("disk", "broadcast", "ipc"),
               f"actor.weight_update_mode must be one of ('disk', 'broadcast', 'ipc'), got "
               f"{self.weight_update_mode!r}")
        _check(self.weight_update_bucket_mb >= 1,
               f"actor.weight_update_bucket_mb must be >= 1, got {self.weight_update_bucket_mb}")
        _check(self.eps_clip > 0, f"actor.eps_clip must be > 0, got {self.eps_clip}")
        _check(self.ppo_n_minibatches >= 1, f"actor.ppo_n_minibatches must be >= 1, got {self.ppo_n_minibatches}")
        _check(self.ppo_epochs >= 1, f"actor.ppo_epochs must be >= 1, got {self.ppo_epochs}")
        _check(not (self.use_decoupled_loss and not self.recompute_logprob),
               "actor.use_decoupled_loss=true needs actor.recompute_logprob=true (the proximal "
               "log-probs are the trainer's recomputation); set one of them accordingly")
        _check_lora_keys(self, "actor")
        self._check_algorithm_keys()

    def _check_algorithm_keys(self) -> None:
        _check(self.c_clip is None or self.c_clip > 1,
               f"actor.c_clip must be > 1 or null (dual clip off), got {self.c_clip}")
        _check(self.reward_clip is None or self.reward_clip > 0,
               f"actor.reward_clip must be > 0 or null (no clip), got {self.reward_clip}")
        modes = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                 "seq-mean-token-sum-norm")
        _check(self.loss_agg_mode in modes,
               f"actor.loss_agg_mode must be one of {modes}, got {self.loss_agg_mode!r}")
        _check(self.importance_sampling_level in ("token", "sequence"),
               "actor.importance_sampling_level must be one of ('token', 'sequence'), got "
               f"{self.importance_sampling_level!r}")
        _check(self.overlong_penalty_factor >= 0,
               f"actor.overlong_penalty_factor must be >= 0, got {self.overlong_penalty_factor}")
        _check(self.max_new_tokens is None or self.max_new_tokens >= 1,
               f"actor.max_new_tokens must be >= 1 or null, got {self.max_new_tokens}")
        if self.overlong_reward_penalty:
            _check(self.overlong_tokens is not None and self.overlong_tokens >= 1,
                   "actor.overlong_reward_penalty=true needs actor.overlong_tokens >= 1 (the "
                   f"penalty window), got {self.overlong_tokens}")
            _check(self.max_new_tokens is None or self.overlong_tokens <= self.max_new_tokens,
                   f"actor.overlong_tokens={self.overlong_tokens} exceeds the generation budget "
                   f"actor.max_new_tokens={self.max_new_tokens}; lower it")
        for name, norm in (("reward_norm", self.reward_norm), ("adv_norm", self.adv_norm)):
            if norm is not None:
                norm.check(name)
        _check(self.kl_ctl >= 0,
               f"actor.kl_ctl must be >= 0 (0 turns the KL off), got {self.kl_ctl}")
        _check(self.kl_estimator in ("k1", "k2", "k3"),
               f"actor.kl_estimator must be one of ('k1', 'k2', 'k3'), got {self.kl_estimator!r}")
        for key in ("discount", "gae_lambda"):
            value = getattr(self, key)
            _check(0 <= value <= 1, f"actor.{key} must be in [0, 1], got {value}")
        self._check_rejection_sampling()
        self._check_distill_keys()

    def _check_rejection_sampling(self) -> None:
        rs, cap = self.rejection_sampling, self.behav_imp_weight_cap
        _check(cap is None or cap > 1,
               f"actor.behav_imp_weight_cap must be > 1 or null (no filter), got {cap}")
        if rs is None:
            return
        rs.check()
        _check(cap is None, f"actor.behav_imp_weight_cap={cap} and actor.rejection_sampling "
               "both set the behaviour-weight filter; set actor.behav_imp_weight_cap=null "
               "(rejection_sampling replaces it)")
        _check(self.use_decoupled_loss, "actor.rejection_sampling filters the proximal/behaviour "
               "weight of the decoupled loss, but actor.use_decoupled_loss=false; set "
               "use_decoupled_loss=true or drop rejection_sampling")

    @property
    def behav_rejection(self) -> Optional[RejectionSamplingConfig]:
        """The filter in force on prox/behav: rejection_sampling, or the cap's shorthand."""
        if self.rejection_sampling is not None:
            return self.rejection_sampling
        if self.behav_imp_weight_cap is None:
            return None
        return RejectionSamplingConfig(upper=self.behav_imp_weight_cap)

    @property
    def updates_per_batch(self) -> int:
        """Optimiser steps per training batch: ppo_n_minibatches in each of ppo_epochs passes."""
        return self.ppo_n_minibatches * self.ppo_epochs

    def _check_distill_keys(self) -> None:
        _check(self.distill_coef >= 0,
               f"actor.distill_coef must be >= 0 (0 turns distillation off), got "
               f"{self.distill_coef}")
        _check(self.distill_mode in ("kl_loss", "on_policy"),
               f"actor.distill_mode must be one of ('kl_loss', 'on_policy'), got "
               f"{self.distill_mode!r}")
        _check(self.distill_kl_estimator in ("k1", "k2", "k3"),
               "actor.distill_kl_estimator must be one of ('k1', 'k2', 'k3'), got "
               f"{self.distill_kl_estimator!r}")
        if self.distill_mode != "on_policy":
            return
        _check(self.distill_coef > 0,
               "actor.distill_mode=on_policy needs actor.distill_coef > 0 (the scale of the "
               "per-token advantage; 1.0 is the plain negative reverse KL)")
        # Pure on-policy distillation has no reward: refuse reward options it would ignore.
        unused = [(key, value) for key, value, default in (
            ("reward_scaling", self.reward_scaling, 1.0), ("reward_bias", self.reward_bias, 0.0),
            ("reward_clip", self.reward_clip, None),
            ("overlong_reward_penalty", self.overlong_reward_penalty, False)) if value != default]
        if self.kl_ctl > 0 and not self.use_kl_loss:
            unused.append(("kl_ctl (in-reward KL)", self.kl_ctl))
        _check(not unused,
               f"actor.distill_mode=on_policy trains on the teacher's per-token signal, not on "
               f"rewards, so these reward options would be ignored: "
               f"{', '.join(f'actor.{k}={v}' for k, v in unused)}; reset them, or use "
               f"actor.use_kl_loss=true for a KL to the reference")


@dataclass(kw_only=True)
class RefConfig:
    """The frozen reference model of the KL term (loaded only when actor.kl_ctl > 0)."""

    # The reference model: HF folder, HF hub id, or a named small model; default: the actor's
    # starting model (with actor.init_from_scratch, the same random weights).
    path: str = "${actor.path}"
    dtype: Literal["bfloat16", "float32"] = "bfloat16"  # compute dtype of its forward
    # Micro-batches of its forward over each training batch.
    mb_spec: MicroBatchSpec = field(default_factory=MicroBatchSpec)


@dataclass(kw_only=True)
class CriticConfig:
    """The value model of PPO with a critic (`critic:`; null, the default, runs without one).

    It is `path`'s decoder with a fresh scalar head (HF `...ForTokenClassification`,
    num_labels 1, seeded by `seed`), trained on the returns of GAE (actor.discount,
    actor.gae_lambda). A critic saved by a run is an HF folder it can start from.
    """

    # The model the critic starts from (HF folder, HF hub id, or a named small model); default:
    # the actor's.
    path: str = "${actor.path}"
    # Random weights of path's architecture, head included (seeded by `seed`).
    init_from_scratch: bool = False
    dtype: Literal["bfloat16", "float32"] = "bfloat16"  # compute dtype; master weights fp32
    # Recompute activations in the backward pass instead of keeping them: less memory, more
    # compute.
    gradient_checkpointing: bool = False
    shared_prefix: bool = False  # as actor.shared_prefix
    # How each training batch is cut into forward/backward micro-batches.
    mb_spec: MicroBatchSpec = field(default_factory=MicroBatchSpec)
    # The critic's own AdamW and lr schedule (which counts ppo_n_minibatches * actor.ppo_epochs
    # steps per batch).
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    # Value clipping (AReaL's critic.eps_clip): the clipped prediction is
    # V_old + clip(V - V_old, -eps_clip, eps_clip); the loss is the worse of the two
    # squared errors. null: no value clipping.
    eps_clip: Optional[float] = 0.5
    ppo_n_minibatches: Optional[int] = None  # optimiser steps per batch; null: the actor's

    def __post_init__(self) -> None:
        _check(self.eps_clip is None or self.eps_clip > 0,
               f"critic.eps_clip must be > 0 or null (no value clipping), got {self.eps_clip}")
        _check(self.ppo_n_minibatches is None or self.ppo_n_minibatches >= 1,
               f"critic.ppo_n_minibatches must be >= 1 or null (the actor's), "
               f"got {self.ppo_n_minibatches}")


@dataclass(kw_only=True)
class TeacherConfig:
    """The frozen teacher of distillation (loaded only when actor.distill_coef > 0).

    It scores the student's tokens, so it must share the actor's tokenizer (checked when
    the run starts). No default path: distilling from the student itself teaches nothing.
    """

    path: str = ""  # HF folder, HF hub id, or a named small model
    dtype: Literal["bfloat16", "float32"] = "bfloat16"  # compute dtype of its forward
    # Micro-batches of its forward over each training batch.
    mb_spec: MicroBatchSpec = field(default_factory=MicroBatchSpec)
