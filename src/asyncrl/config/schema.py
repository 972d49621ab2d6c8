"""One dataclass per component. Keys follow AReaL's names and meanings.

Every field is documented where it is declared. Cross-field checks live in
`__post_init__`, so a bad combination fails when the config is loaded, with a message that
says what to change. `${...}` interpolations are resolved by the loader (OmegaConf).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from asyncrl.config.allocation import parse_allocation_mode

NormLevel = Literal["batch", "group", "none"]


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclass(kw_only=True)
class ClusterConfig:
    n_nodes: int = 1  # more than one needs a multi-node scheduler (not available yet)
    n_gpus_per_node: int = 0  # 0: a CPU machine
    # Root of run directories: <fileroot>/<experiment_name>/<trial_name>/. Empty: the user
    # cache dir (~/.cache/asyncrl/experiments).
    fileroot: str = ""


@dataclass(kw_only=True)
class SchedulerConfig:
    type: Literal["local"] = "local"
    # CPU cores given to the inference server(s) and to the trainer. On a CPU machine both run
    # at once; None splits the machine's cores evenly. Servers are pinned to their cores.
    inference_threads: Optional[int] = None
    trainer_threads: Optional[int] = None
    # Seconds to wait for a server's /health before giving up (its log tail is shown).
    startup_timeout: float = 300.0


@dataclass(kw_only=True)
class LocalEngineConfig:
    """The `local` inference server (our own engine; base install)."""

    dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    max_batch_size: int = 64  # concurrent sequences decoded together (KV-cache slots)
    max_seq_len: int = 2048  # prompt + completion tokens per slot
    # After a weight update, recompute the KV cache of in-flight sequences under the new
    # weights, so their later tokens (and log-probs) are exactly the new policy's.
    recompute_kv_on_update: bool = True

    def __post_init__(self) -> None:
        _check(self.max_batch_size >= 1, f"local_engine.max_batch_size must be >= 1, got {self.max_batch_size}")
        _check(self.max_seq_len >= 16, f"local_engine.max_seq_len must be >= 16, got {self.max_seq_len}")


@dataclass(kw_only=True)
class GenerationConfig:
    """`gconfig`: how completions are sampled during training rollouts."""

    n_samples: int = 4  # completions per prompt (the GRPO group size)
    max_new_tokens: int = 256
    min_new_tokens: int = 0
    greedy: bool = False  # overrides temperature with 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    stop_token_ids: list[int] = field(default_factory=list)  # besides the tokenizer's EOS
    stop: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check(self.n_samples >= 1, f"gconfig.n_samples must be >= 1, got {self.n_samples}")
        _check(self.max_new_tokens >= 1, f"gconfig.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _check(self.min_new_tokens == 0, "gconfig.min_new_tokens other than 0 is not supported yet")
        _check(self.temperature >= 0, f"gconfig.temperature must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, f"gconfig.top_p must be in (0, 1], got {self.top_p}")

    @property
    def effective_temperature(self) -> float:
        return 0.0 if self.greedy else self.temperature


@dataclass(kw_only=True)
class RolloutConfig:
    # eta: an episode may start only while accepted + running < (eta + version + 1) * B,
    # where B = consumer_batch_size. 0 is synchronous RL.
    max_head_offpolicyness: int = 0
    # Episodes (prompts; each yields gconfig.n_samples trajectories) per training step.
    consumer_batch_size: int = 8
    # Episodes in flight at most. None: consumer_batch_size * (max_head_offpolicyness + 1).
    max_concurrent_rollouts: Optional[int] = None
    # The inference servers: "local" (ours), "vllm" or "sglang" (pip install asyncrl[vllm]
    # / sglang). null: from allocation_mode, else "local". Set both only if they agree.
    backend: Optional[Literal["local", "vllm", "sglang"]] = None
    n_servers: Optional[int] = None  # null: from allocation_mode, else 1
    request_timeout: float = 3600.0  # seconds for one generation request
    request_retries: int = 3  # retries when a server cannot be reached
    update_weights_timeout: float = 300.0  # seconds for pause + reload + resume per server
    # Seconds between checks that bring a server that failed back (re-synced to the current
    # weights) into routing; null: only when no server is left.
    health_check_interval: Optional[float] = 10.0
    # Appended to every server's command line (e.g. vLLM's ["--max-num-batched-tokens", "4096"]).
    server_args: list[str] = field(default_factory=list)
    # Failed episodes (reward raised or timed out, malformed item) are logged and counted;
    # the run stops once more than this many have failed. -1: never stop for failures.
    max_failed_episodes: int = 16
    # DAPO dynamic sampling: drop finished episodes (groups) whose trajectories all got the
    # same reward (zero advantage under group normalisation) and keep sampling until the
    # batch holds consumer_batch_size kept groups. Dropped groups free their slot.
    dynamic_sampling: bool = False
    # With dynamic_sampling: "package.module:function" taking an episode's trajectories and
    # returning True to keep it. null: the built-in filter (drop groups of equal rewards).
    dynamic_filter_fn: Optional[str] = None

    def __post_init__(self) -> None:
        _check(self.max_head_offpolicyness >= 0,
               f"rollout.max_head_offpolicyness must be >= 0, got {self.max_head_offpolicyness}")
        _check(self.consumer_batch_size >= 1,
               f"rollout.consumer_batch_size must be >= 1, got {self.consumer_batch_size}")
        _check(self.max_concurrent_rollouts is None or self.max_concurrent_rollouts >= 1,
               f"rollout.max_concurrent_rollouts must be >= 1 or null, got {self.max_concurrent_rollouts}")
        _check(self.n_servers is None or self.n_servers >= 1,
               f"rollout.n_servers must be >= 1 or null, got {self.n_servers}")
        _check(self.health_check_interval is None or self.health_check_interval > 0,
               f"rollout.health_check_interval must be > 0 or null, got {self.health_check_interval}")
        _check(self.dynamic_filter_fn is None or self.dynamic_sampling,
               f"rollout.dynamic_filter_fn={self.dynamic_filter_fn!r} is used only with "
               "rollout.dynamic_sampling=true; set it, or drop dynamic_filter_fn")

    @property
    def concurrency(self) -> int:
        if self.max_concurrent_rollouts is not None:
            return self.max_concurrent_rollouts
        return self.consumer_batch_size * (self.max_head_offpolicyness + 1)


@dataclass(kw_only=True)
class OptimizerConfig:
    type: Literal["adam"] = "adam"  # AdamW (decoupled weight decay)
    lr: float = 1e-6
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps_proportion: float = 0.0  # of the total training steps
    min_lr_ratio: float = 0.0  # the final lr of linear/cosine decay, as a fraction of lr
    gradient_clipping: float = 1.0  # max global grad norm; 0 disables clipping

    def __post_init__(self) -> None:
        _check(self.lr > 0, f"optimizer.lr must be > 0, got {self.lr}")
        _check(0 <= self.warmup_steps_proportion < 1,
               f"optimizer.warmup_steps_proportion must be in [0, 1), got {self.warmup_steps_proportion}")


@dataclass(kw_only=True)
class MicroBatchSpec:
    # Tokens (padding included) per forward/backward micro-batch; a longer sequence gets
    # a micro-batch of its own.
    max_tokens_per_mb: int = 8192
    # Consecutive rows that always share a micro-batch (and a data-parallel rank): a loss
    # over several rows, like DPO's (chosen, rejected) pairs, needs them together.
    granularity: int = 1

    def __post_init__(self) -> None:
        _check(self.max_tokens_per_mb >= 1, f"mb_spec.max_tokens_per_mb must be >= 1, got {self.max_tokens_per_mb}")
        _check(self.granularity >= 1, f"mb_spec.granularity must be >= 1, got {self.granularity}")


@dataclass(kw_only=True)
class NormConfig:
    """Normalisation of rewards or advantages: subtract a mean, divide by a std."""

    mean_level: NormLevel = "group"
    std_level: NormLevel = "group"
    group_size: Optional[int] = None  # samples per group; None: gconfig.n_samples
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


@dataclass(kw_only=True)
class ActorConfig:
    path: str = "smollm2-135m-instruct"  # HF folder, HF hub id, or a named small model
    init_from_scratch: bool = False
    dtype: Literal["bfloat16", "float32"] = "bfloat16"  # compute dtype; master weights fp32
    gradient_checkpointing: bool = False
    mb_spec: MicroBatchSpec = field(default_factory=MicroBatchSpec)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    # The temperature the behaviour log-probs were computed at (logits / T).
    temperature: float = 1.0
    eps_clip: float = 0.2  # PPO clip: ratio in [1 - eps_clip, 1 + eps_clip_higher]
    eps_clip_higher: Optional[float] = None  # None: eps_clip (symmetric)
    reward_scaling: float = 1.0  # r <- (r + reward_bias) * reward_scaling
    reward_bias: float = 0.0
    reward_clip: Optional[float] = None  # clip the shaped reward to [-c, c]; None: no clip
    # DAPO's soft overlong punishment: a completion longer than max_new_tokens - overlong_tokens
    # loses overlong_penalty_factor * (excess / overlong_tokens) of reward (before shaping).
    overlong_reward_penalty: bool = False
    overlong_tokens: Optional[int] = None  # the penalty window; needed when the penalty is on
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
    # false: KL as a reward penalty, r <- r - kl_ctl * sum of kl_t over the completion,
    # before normalisation (AReaL/verl in-reward KL). true: + kl_ctl * agg(kl_t) in the loss
    # (GRPO, verl use_kl_loss), with gradient through the policy log-probs.
    use_kl_loss: bool = False
    # GAE (Schulman et al. 2015): the reward discount gamma and the bias/variance trade-off
    # lambda, over the completion tokens. With a critic, advantages are GAE over its values;
    # without, over values of 0 (gamma = lambda = 1 is the sequence reward on every token).
    discount: float = 1.0
    gae_lambda: float = 1.0
    # Distillation from the `teacher` model on the student's own samples. 0: off, and no
    # teacher is loaded. kl_loss: + distill_coef * agg(k(d)) in the loss, d = logp -
    # teacher_logp, beside the RL objective. on_policy: pure on-policy distillation, the
    # per-token advantage is -distill_coef * (behaviour logp - teacher logp); rewards unused.
    distill_coef: float = 0.0
    distill_mode: Literal["kl_loss", "on_policy"] = "kl_loss"
    # The loss term's estimator of KL(student || teacher) from d (as kl_estimator). On the
    # student's samples the gradient of k2 is that of the reverse KL; k3's is the forward
    # KL's; k1's is zero in expectation. Not used by on_policy (its advantage is -k1).
    distill_kl_estimator: Literal["k1", "k2", "k3"] = "k2"

    def __post_init__(self) -> None:
        _check(self.temperature > 0, "actor.temperature must be > 0 (use 1.0 when sampling greedily)")
        _check(self.eps_clip > 0, f"actor.eps_clip must be > 0, got {self.eps_clip}")
        _check(self.ppo_n_minibatches >= 1, f"actor.ppo_n_minibatches must be >= 1, got {self.ppo_n_minibatches}")
        _check(self.ppo_epochs >= 1, f"actor.ppo_epochs must be >= 1, got {self.ppo_epochs}")
        _check(not (self.use_decoupled_loss and not self.recompute_logprob),
               "actor.use_decoupled_loss=true needs actor.recompute_logprob=true (the proximal "
               "log-probs are the trainer's recomputation); set one of them accordingly")
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

    path: str = "${actor.path}"
    dtype: Literal["bfloat16", "float32"] = "bfloat16"  # compute dtype of its forward
    mb_spec: MicroBatchSpec = field(default_factory=MicroBatchSpec)


@dataclass(kw_only=True)
class CriticConfig:
    """The value model of PPO with a critic (`critic:`; null, the default, runs without one).

    It is `path`'s decoder with a fresh scalar head (HF `...ForTokenClassification`,
    num_labels 1, seeded by `seed`), trained on the returns of GAE (actor.discount,
    actor.gae_lambda). A critic saved by a run is an HF folder it can start from.
    """

    path: str = "${actor.path}"
    init_from_scratch: bool = False
    dtype: Literal["bfloat16", "float32"] = "bfloat16"  # compute dtype; master weights fp32
    gradient_checkpointing: bool = False
    mb_spec: MicroBatchSpec = field(default_factory=MicroBatchSpec)
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
    mb_spec: MicroBatchSpec = field(default_factory=MicroBatchSpec)


@dataclass(kw_only=True)
class DatasetConfig:
    # A local JSONL file or folder of JSONL files (GSM8K format: question / answer with
    # "#### N"), an HF dataset id, or "reasoning_gym:<task>" for a generated offline task.
    path: str = ""
    type: Literal["rl"] = "rl"
    batch_size: int = 8  # prompts per training step (or per evaluation batch)
    shuffle: bool = True
    max_length: Optional[int] = None  # prompts longer than this (tokens) are dropped
    size: Optional[int] = None  # keep the first `size` rows (or generate this many tasks)
    split: str = "train"  # for HF ids and folders holding <split>.jsonl
    task_kwargs: dict[str, Any] = field(default_factory=dict)  # reasoning-gym task options
    # reasoning-gym generation seed. Item i of seed s comes from Random(s + i), so train and
    # validation seeds must differ by more than the dataset size to share no items.
    seed: int = 0


@dataclass(kw_only=True)
class WorkflowConfig:
    type: Literal["rlvr"] = "rlvr"
    # "gsm8k" (math-verify on "#### N" or \boxed{}), "reasoning_gym" (the task's own scorer),
    # "reward_model" (a model trained by `asyncrl rm`, at reward_model_path), or
    # "package.module:function" taking (completion, item) -> float.
    # null: no reward (only for actor.distill_mode=on_policy, which does not use one).
    reward_fn: Optional[str] = "gsm8k"
    reward_model_path: Optional[str] = None  # only with reward_fn: reward_model
    reward_timeout: float = 15.0  # seconds; a reward that takes longer counts as failed
    system_prompt: Optional[str] = None
    # Worked examples shown before the question, as chat turns (one-shot prompting).
    few_shot: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        uses_model = self.reward_fn == "reward_model"
        _check(uses_model == bool(self.reward_model_path),
               "workflow.reward_fn=reward_model needs workflow.reward_model_path (a folder "
               "written by `asyncrl rm`)" if uses_model else
               f"workflow.reward_model_path is set but workflow.reward_fn={self.reward_fn!r}; "
               "set reward_fn=reward_model or drop reward_model_path")


@dataclass(kw_only=True)
class SaverConfig:
    """HF-format weights under <run>/checkpoints/step<N>/ (None disables a trigger)."""

    freq_steps: Optional[int] = None
    freq_epochs: Optional[int] = None
    freq_secs: Optional[float] = None


@dataclass(kw_only=True)
class RecoverConfig:
    # disabled: start fresh. auto: resume from <run>/recover/ if a checkpoint is there.
    # resume: resume, and fail if there is none.
    mode: Literal["disabled", "auto", "resume"] = "disabled"
    freq_steps: Optional[int] = None
    freq_epochs: Optional[int] = None
    freq_secs: Optional[float] = 3600.0


@dataclass(kw_only=True)
class EvaluatorConfig:
    """Greedy evaluation on valid_dataset (before training, every freq_steps, after)."""

    freq_steps: Optional[int] = None
    freq_epochs: Optional[int] = None
    freq_secs: Optional[float] = None
    before_training: bool = True
    after_training: bool = True
    max_new_tokens: Optional[int] = None  # None: gconfig.max_new_tokens


@dataclass(kw_only=True)
class StatsLoggerConfig:
    jsonl: bool = True  # <run>/stats.jsonl
    tensorboard: bool = True  # <run>/tensorboard/
    progress_bar: bool = True
    plot: bool = True  # <run>/reward_curve.png at the end


@dataclass(kw_only=True)
class ExperimentConfig:
    experiment_name: str = "asyncrl"
    trial_name: str = "trial0"
    seed: int = 1
    total_train_epochs: int = 1
    total_train_steps: Optional[int] = None  # stop earlier than the epochs allow
    tokenizer_path: str = "${actor.path}"  # the tokenizer of prompts and completions
    # AReaL's "<backend>:d<N>+fsdp:d<M>", e.g. "vllm:d2+fsdp:d1": sets rollout.backend and
    # rollout.n_servers (which may then only repeat it) and the trainer world size M.
    allocation_mode: Optional[str] = None
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    local_engine: LocalEngineConfig = field(default_factory=LocalEngineConfig)
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)  # used only when actor.kl_ctl > 0
    critic: Optional[CriticConfig] = None  # PPO with a value model; `critic: {}` for defaults
    teacher: TeacherConfig = field(default_factory=TeacherConfig)  # actor.distill_coef > 0
    workflow: WorkflowConfig = field(default_factory=WorkflowConfig)
    train_dataset: DatasetConfig = field(default_factory=DatasetConfig)
    valid_dataset: Optional[DatasetConfig] = None
    saver: SaverConfig = field(default_factory=SaverConfig)
    recover: RecoverConfig = field(default_factory=RecoverConfig)
    evaluator: EvaluatorConfig = field(default_factory=EvaluatorConfig)
    stats_logger: StatsLoggerConfig = field(default_factory=StatsLoggerConfig)

    def __post_init__(self) -> None:
        _check(self.total_train_epochs >= 1, f"total_train_epochs must be >= 1, got {self.total_train_epochs}")
        _check(self.total_train_steps is None or self.total_train_steps >= 1,
               f"total_train_steps must be >= 1 or null, got {self.total_train_steps}")
        _check(self.cluster.n_nodes == 1,
               f"cluster.n_nodes={self.cluster.n_nodes} but scheduler.type=local runs on one "
               "machine; set cluster.n_nodes=1")
        self._resolve_allocation()
        _check(bool(self.train_dataset.path), "train_dataset.path is empty: give a JSONL file or "
               "folder, an HF dataset id, or reasoning_gym:<task>")
        for name, norm in (("reward_norm", self.actor.reward_norm), ("adv_norm", self.actor.adv_norm)):
            if norm is None:
                continue
            if norm.group_size is None:
                norm.group_size = self.gconfig.n_samples
            elif "group" in (norm.mean_level, norm.std_level):
                _check(norm.group_size == self.gconfig.n_samples,
                       f"actor.{name}.group_size={norm.group_size} but gconfig.n_samples="
                       f"{self.gconfig.n_samples}; set actor.{name}.group_size=${{gconfig.n_samples}}")
            norm.check(name)  # again, now that group_size is known
        self._resolve_max_new_tokens()
        _check(not self.rollout.dynamic_sampling or self.rollout.dynamic_filter_fn is not None
               or self.gconfig.n_samples >= 2,
               "rollout.dynamic_sampling=true drops groups whose rewards are all equal, and a "
               "group of gconfig.n_samples=1 always is; raise gconfig.n_samples to >= 2")
        if self.critic is not None and self.critic.ppo_n_minibatches is None:
            self.critic.ppo_n_minibatches = self.actor.ppo_n_minibatches
        self._check_distillation()

    def _check_distillation(self) -> None:
        """A teacher exactly when distilling; no reward fn only where no reward is used."""
        coef = self.actor.distill_coef
        _check(coef == 0 or bool(self.teacher.path),
               f"actor.distill_coef={coef} but teacher.path is empty: give the teacher model "
               "(an HF folder or name sharing the actor's tokenizer)")
        _check(coef > 0 or not self.teacher.path,
               f"teacher.path={self.teacher.path!r} is set but actor.distill_coef=0, so no "
               "teacher would be loaded; set actor.distill_coef > 0 or drop teacher.path")
        _check(not (self.actor.distill_mode == "on_policy" and coef > 0 and self.critic),
               "actor.distill_mode=on_policy takes its advantages from the teacher, so a critic "
               "(trained on reward returns) would be unused; drop the critic section")
        if self.workflow.reward_fn is not None:
            return
        _check(self.actor.distill_mode == "on_policy" and coef > 0,
               "workflow.reward_fn is null, but only pure on-policy distillation "
               "(actor.distill_mode=on_policy, actor.distill_coef > 0) trains without a "
               "reward; set workflow.reward_fn")
        _check(self.valid_dataset is None,
               "workflow.reward_fn is null but valid_dataset is set: evaluation scores "
               "answers with the reward fn; drop valid_dataset or set workflow.reward_fn")

    def _resolve_max_new_tokens(self) -> None:
        """actor.max_new_tokens (the overlong penalty's budget) is gconfig.max_new_tokens."""
        budget = self.gconfig.max_new_tokens
        _check(self.actor.max_new_tokens in (None, budget),
               f"actor.max_new_tokens={self.actor.max_new_tokens} but gconfig.max_new_tokens="
               f"{budget}; drop actor.max_new_tokens (it is filled from gconfig)")
        self.actor.max_new_tokens = budget
        actor = self.actor
        _check(not actor.overlong_reward_penalty or actor.overlong_tokens <= budget,
               f"actor.overlong_tokens={actor.overlong_tokens} exceeds gconfig.max_new_tokens="
               f"{budget}; lower actor.overlong_tokens")

    def _resolve_allocation(self) -> None:
        """allocation_mode, when given, decides rollout.backend and n_servers; they must agree."""
        if self.allocation_mode is None:
            self.rollout.backend = self.rollout.backend or "local"
            self.rollout.n_servers = self.rollout.n_servers or 1
            return
        alloc = parse_allocation_mode(self.allocation_mode)
        for key, have, want in (("backend", self.rollout.backend, alloc.backend),
                                ("n_servers", self.rollout.n_servers, alloc.n_servers)):
            _check(have is None or have == want,
                   f"rollout.{key}={have} contradicts allocation_mode={self.allocation_mode!r} "
                   f"(which means {want}); drop rollout.{key} or make them agree")
        self.rollout.backend, self.rollout.n_servers = alloc.backend, alloc.n_servers
        gpus = self.cluster.n_gpus_per_node
        _check(gpus == 0 or alloc.n_servers + alloc.trainer_world_size <= gpus,
               f"allocation_mode={self.allocation_mode!r} needs {alloc.n_servers} inference + "
               f"{alloc.trainer_world_size} trainer GPUs but cluster.n_gpus_per_node={gpus}")

    @property
    def trainer_world_size(self) -> int:
        """Trainer ranks: allocation_mode's fsdp:d<M>, else 1."""
        if self.allocation_mode is None:
            return 1
        return parse_allocation_mode(self.allocation_mode).trainer_world_size
