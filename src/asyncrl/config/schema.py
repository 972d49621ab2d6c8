"""One dataclass per component of an RL run. Keys follow AReaL's names and meanings.

The actor, reference, critic and teacher sections are in `config/algorithm.py`; the
optimiser and micro-batch sections, shared by every trainer, in `config/engine.py`.

Every field is documented where it is declared. Cross-field checks live in
`__post_init__`, so a bad combination fails when the config is loaded, with a message that
says what to change. `${...}` interpolations are resolved by the loader (OmegaConf).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

# The actor's and the trainer's sections live in their own modules; they are re-exported
# here so that `asyncrl.config.schema` stays the one namespace of every config class.
from asyncrl.config.algorithm import (  # noqa: F401
    ActorConfig,
    CriticConfig,
    NormConfig,
    RefConfig,
    RejectionSamplingConfig,
    TeacherConfig,
)
from asyncrl.config.allocation import (
    Allocation,
    parse_allocation_mode,
    parse_rollout_backend,
    parse_train_backend,
)
from asyncrl.config.engine import MicroBatchSpec, OptimizerConfig, _check  # noqa: F401


@dataclass(kw_only=True)
class ClusterConfig:
    n_nodes: int = 1  # more than one needs scheduler.type ray or slurm
    n_gpus_per_node: int = 0  # 0: a CPU machine
    # Root of run directories: <fileroot>/<experiment_name>/<trial_name>/. Empty: the user
    # cache dir (~/.cache/asyncrl/experiments).
    fileroot: str = ""

    @property
    def device(self) -> Literal["cpu", "cuda"]:
        """Where the trainer ranks compute: CUDA when the nodes have GPUs, else the CPU."""
        return "cuda" if self.n_gpus_per_node > 0 else "cpu"


@dataclass(kw_only=True)
class RayConfig:
    # An existing cluster to join ("auto", "ray://host:port", "host:port"); None starts a
    # Ray instance on this machine.
    address: Optional[str] = None


@dataclass(kw_only=True)
class SlurmConfig:
    partition: Optional[str] = None  # sbatch --partition of every job (None: the default)
    account: Optional[str] = None  # sbatch --account (None: the user's default)
    time: str = "24:00:00"  # sbatch --time of every job
    extra_sbatch_args: list[str] = field(default_factory=list)  # e.g. ["--qos=high"]


@dataclass(kw_only=True)
class SchedulerConfig:
    # Who starts the processes: local subprocesses, Ray actors, or Slurm jobs.
    type: Literal["local", "ray", "slurm"] = "local"
    # Where the trainer ranks run: `inline` in the controller process (one rank, local
    # scheduler only), `service` as training-service processes (one per rank), `auto`:
    # inline for one local rank, else service.
    trainer: Literal["auto", "inline", "service"] = "auto"
    # Seconds one call to the trainer ranks (a whole RL step, a save) may take.
    trainer_timeout: float = 3600.0
    # Where the agent proxy runs (workflow.type=agent): `inline` on the controller's rollout
    # loop, `service` as its own process (agents/service.py) started by the scheduler;
    # `auto`: inline under the local scheduler, else service.
    agent: Literal["auto", "inline", "service"] = "auto"
    # Where requests are routed to the inference servers: `inline` by the controller's own
    # client (and the agent service's), `service` by a router process (inference/router.py)
    # that both go through; `auto`: inline under the local scheduler, else service.
    router: Literal["auto", "inline", "service"] = "auto"
    # Who carries each weight version from the trainer ranks to the servers: `inline` the
    # controller, `service` a weight-update process (controller/weight_update.py; needs the
    # trainer ranks as a service); `auto`: service off the local scheduler when the trainer
    # ranks are a service, else inline.
    weight_update: Literal["auto", "inline", "service"] = "auto"
    # CPU cores given to the inference server(s) and to the trainer. On a CPU machine both run
    # at once; None splits the machine's cores evenly. Servers are pinned to their cores.
    # Under ray and slurm: the cores of each server and of each trainer rank (default 1).
    inference_threads: Optional[int] = None
    # The trainer's cores, as above. None on a local CPU machine: the cores the servers leave
    # (half the machine when inference_threads is None too).
    trainer_threads: Optional[int] = None
    # Local scheduler, CPU, `local` backend, inline trainer: the cores above are each side's
    # home, and a busy side also runs on the cores of an idle one (the trainer while the
    # staleness bound holds the server back, the server while the trainer waits), taken up
    # and given back within one decoder layer or decode step (api/cores.py). false: a fixed split.
    share_cores: bool = True
    # Seconds to wait for a server's /health before giving up (its log tail is shown).
    startup_timeout: float = 300.0


@dataclass(kw_only=True)
class LocalEngineConfig:
    """The `local` inference server (our own engine; base install)."""

    # The servers' weight dtype (their --dtype, whatever rollout.backend) and the dtype each
    # weight version is published in.
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
    # Tokens per completion at most (a cap on each agent request). Also actor.max_new_tokens
    # (the overlong penalty's and seq-mean-token-sum-norm's budget) and evaluation's, unless
    # evaluator.max_new_tokens is set.
    max_new_tokens: int = 256
    # AReaL's key; only 0 (no minimum) is supported.
    min_new_tokens: int = 0
    greedy: bool = False  # overrides temperature with 0
    # Sampling temperature: logits / temperature; 0 is greedy. The trainer's log-probs use
    # actor.temperature, which should be the same.
    temperature: float = 1.0
    # Nucleus sampling: only the most likely tokens whose probabilities reach top_p are kept
    # (1: off).
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    stop_token_ids: list[int] = field(default_factory=list)  # besides the tokenizer's EOS
    # Stop strings (rlvr): a completion ends once its text contains one.
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
    # How far ahead of training episodes start. "demand": only as far as the trainer needs
    # not to wait for its batches (the first batch alone, then one version ahead, one more
    # each time it waited, one less when a whole batch was left over; never past eta; on
    # cores shared with the servers, one; `rollout/ahead` in the stats), so a run whose
    # generation outruns its training trains on fresher samples. "bound": as far as eta
    # allows (AReaL's rule). The same with eta=0.
    admission: Literal["demand", "bound"] = "demand"
    # Episodes (prompts; each yields gconfig.n_samples trajectories) per training step.
    consumer_batch_size: int = 8
    # Episodes in flight at most. None: consumer_batch_size * (max_head_offpolicyness + 1).
    max_concurrent_rollouts: Optional[int] = None
    # The inference servers: "local" (ours), "vllm" or "sglang" (pip install asyncrl[vllm]
    # / sglang), optionally with AReaL's layout: "vllm:d<N>t<T>" is N servers of T GPUs
    # each (tensor parallel: vLLM's --tensor-parallel-size, SGLang's --tp-size; not our
    # engine); "sglang:d<N>t<T>e<E>" splits an MoE model's experts over E of them (SGLang's
    # --ep-size; vLLM's --enable-expert-parallel, E = T). null: from allocation_mode, else
    # "local". Set it and allocation_mode only if they agree. Once loaded it holds the name
    # alone (the layout: allocation_mode).
    backend: Optional[str] = None
    n_servers: Optional[int] = None  # null: from allocation_mode or backend's d<N>, else 1
    request_timeout: float = 3600.0  # seconds for one generation request
    request_retries: int = 3  # retries when a server cannot be reached
    update_weights_timeout: float = 300.0  # seconds for pause + reload + resume per server
    # Seconds between checks that bring a server that failed back (re-synced to the current
    # weights) into routing; null: only when no server is left.
    health_check_interval: Optional[float] = 10.0
    # Seconds a generation request waits for a server to come back when none is live (the
    # run restarts dead servers it started); after that the run stops with the cause.
    server_wait_timeout: float = 120.0
    # Appended to every server's command line (e.g. vLLM's ["--max-num-batched-tokens", "4096"]).
    server_args: list[str] = field(default_factory=list)
    # GPU servers: the fraction of their GPU's memory each server may take (weights, KV cache,
    # activations): vLLM's --gpu-memory-utilization, SGLang's --mem-fraction-static, and our
    # engine's budget, from which it sizes its KV cache (fewer than local_engine.max_batch_size
    # slots if they do not fit). With a colocated allocation_mode ('|') the trainer keeps the
    # rest (its allocator is capped at 1 - this). null: 0.5 when colocated, else the backend's
    # default (vLLM 0.9; ours: max_batch_size slots, no cap). Not for CPU servers.
    gpu_memory_fraction: Optional[float] = None
    # Failed episodes (reward raised or timed out, malformed item) are logged and counted;
    # the run stops once more than this many have failed. -1: never stop for failures.
    max_failed_episodes: int = 16
    # Runs of a failed episode's item before it counts as failed: a reward that crashed or
    # timed out, a sandbox that died. Every failed run is written to <run>/failures.jsonl.
    episode_retries: int = 1
    # Each item drawn gets a seed from (seed, its draw number) and each sample its own random
    # stream from it (SamplingParams.seed): the same weights sample the same tokens for it
    # whatever the server batches with it, also when it is run again after a resume. Off:
    # the servers' shared random stream.
    seeded_sampling: bool = True
    # DAPO dynamic sampling: drop finished episodes (groups) whose trajectories all got the
    # same reward (zero advantage under group normalisation) and keep sampling until the
    # batch holds consumer_batch_size kept groups. Dropped groups free their slot.
    dynamic_sampling: bool = False
    # With dynamic_sampling: "package.module:function" taking an episode's trajectories and
    # returning True to keep it. null: the built-in filter (drop groups of equal rewards).
    dynamic_filter_fn: Optional[str] = None
    # Agent sessions: one that started more than this many weight versions before the
    # served ones ends (status version_lag, its requests get 409, it is not trained).
    # null: off (the staleness bound still applies to whole episodes).
    max_session_version_lag: Optional[int] = None

    def __post_init__(self) -> None:
        _check(self.max_session_version_lag is None or self.max_session_version_lag >= 0,
               "rollout.max_session_version_lag must be >= 0 or null, got "
               f"{self.max_session_version_lag}")
        _check(self.max_head_offpolicyness >= 0,
               f"rollout.max_head_offpolicyness must be >= 0, got {self.max_head_offpolicyness}")
        _check(self.admission in ("demand", "bound"),
               f"rollout.admission must be 'demand' or 'bound', got {self.admission!r}")
        _check(self.consumer_batch_size >= 1,
               f"rollout.consumer_batch_size must be >= 1, got {self.consumer_batch_size}")
        _check(self.max_concurrent_rollouts is None or self.max_concurrent_rollouts >= 1,
               f"rollout.max_concurrent_rollouts must be >= 1 or null, got {self.max_concurrent_rollouts}")
        _check(self.n_servers is None or self.n_servers >= 1,
               f"rollout.n_servers must be >= 1 or null, got {self.n_servers}")
        if self.backend is not None:
            parse_rollout_backend(self.backend)  # raises naming rollout.backend
        _check(self.gpu_memory_fraction is None or 0 < self.gpu_memory_fraction < 1,
               f"rollout.gpu_memory_fraction must be in (0, 1) or null, got "
               f"{self.gpu_memory_fraction}")
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
class DatasetConfig:
    # A local JSONL file or folder of JSONL files (GSM8K format: question / answer with
    # "#### N"), an HF dataset id, or "reasoning_gym:<task>" for a generated offline task.
    path: str = ""
    # AReaL's dataset type; "rl" (question / answer items) is the only one.
    type: Literal["rl"] = "rl"
    batch_size: int = 8  # prompts per training step (or per evaluation batch)
    # train_dataset: items reshuffled every epoch from (seed, epoch); false: file order.
    # valid_dataset is never shuffled.
    shuffle: bool = True
    max_length: Optional[int] = None  # prompts longer than this (tokens) are dropped
    size: Optional[int] = None  # keep the first `size` rows (or generate this many tasks)
    split: str = "train"  # for HF ids and folders holding <split>.jsonl
    task_kwargs: dict[str, Any] = field(default_factory=dict)  # reasoning-gym task options
    # reasoning-gym generation seed. Item i of seed s comes from Random(s + i), so train and
    # validation seeds must differ by more than the dataset size to share no items.
    seed: int = 0
    # Malformed JSONL rows (bad JSON, a missing or empty question or answer): "skip" leaves
    # them out and logs how many, naming each file and line; "error" stops at the first.
    bad_rows: Literal["skip", "error"] = "skip"


@dataclass(kw_only=True)
class WorkflowConfig:
    # rlvr: one prompt, n sampled answers, a verifiable reward (workflow.reward_fn).
    # agent: n sessions of an agent through the agent proxy (the `agent:` section); the
    # agent returns the reward, reward_fn is not used.
    type: Literal["rlvr", "agent"] = "rlvr"
    # "gsm8k" (math-verify on "#### N" or \boxed{}), "reasoning_gym" (the task's own scorer),
    # "code" (the share of the item's tests its program passes, in the sandbox),
    # "short_answer" (a word, number or yes/no, exact match after normalisation),
    # "marked_short_answer" (the same, after the completion's last "Answer:"),
    # "reward_model" (a model trained by `asyncrl rm`, at reward_model_path), or
    # "package.module:function" taking (completion, item) -> float.
    # null: no reward (only for actor.distill_mode=on_policy, which does not use one).
    reward_fn: Optional[str] = "gsm8k"
    reward_model_path: Optional[str] = None  # only with reward_fn: reward_model
    reward_timeout: float = 15.0  # seconds; a reward that takes longer counts as failed
    # rlvr: a system message put before every prompt (and its few_shot turns); null: none.
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
class AgentConfig:
    """Agents trained through the agent proxy (workflow.type=agent); see docs/guides/agents.md."""

    # inline: `fn` is called in the rollout loop; subprocess: `command` runs per session;
    # online: outside clients start sessions themselves (POST /rl/start_session).
    mode: Literal["inline", "subprocess", "online"] = "inline"
    # inline: "package.module:function" or "path/to/file.py:function", an async function
    # (base_url, api_key, item) -> reward (None: the agent set it via /rl/set_reward).
    fn: Optional[str] = None
    # subprocess: the command (gets OPENAI_BASE_URL, OPENAI_API_KEY, ASYNCRL_TASK_FILE...).
    command: list[str] = field(default_factory=list)
    timeout: float = 600.0  # seconds per session (inline / subprocess)
    # tree: a conversation's turns merged into one trajectory per leaf (exact token
    # prefixes only); individual: one trajectory per completion.
    export_style: Literal["tree", "individual"] = "tree"
    turn_discount: float = 1.0  # G_i = r_i + turn_discount * G_{i+1} over the completions
    session_timeout: float = 300.0  # an idle session ends as timed_out (never trained)
    # The model's tool-call format: hermes | llama3_json | mistral; None reads it from the
    # tokenizer's chat template (hermes when the template has no tool format).
    tool_parser: Optional[str] = None
    # The proxy's address. 127.0.0.1 unless told otherwise; port 0 picks a free one.
    host: str = "127.0.0.1"
    # The proxy's port; 0: a free one, picked when it starts.
    port: int = 0
    # The bearer key of /rl/start_session; online needs one (e.g. ${oc.env:ASYNCRL_ADMIN_KEY}).
    admin_key: Optional[str] = None
    # online: subtract each task's running mean reward (a session is its own group).
    baseline: bool = True
    # Also write every finished session as JSONL (sessions.jsonl, trajectories.jsonl) here.
    export_dir: Optional[str] = None

    def __post_init__(self) -> None:
        _check(self.timeout > 0, f"agent.timeout must be > 0, got {self.timeout}")
        _check(self.session_timeout > 0,
               f"agent.session_timeout must be > 0, got {self.session_timeout}")
        _check(self.tool_parser in (None, "hermes", "llama3_json", "mistral"),
               f"agent.tool_parser must be hermes, llama3_json, mistral or null, got "
               f"{self.tool_parser!r}")
        _check(0 < self.turn_discount <= 1,
               f"agent.turn_discount must be in (0, 1], got {self.turn_discount}")
        _check(0 <= self.port < 65536, f"agent.port must be in [0, 65535], got {self.port}")

    def check_mode(self) -> None:
        """What the chosen mode needs (checked only when workflow.type=agent)."""
        _check(self.mode != "inline" or bool(self.fn),
               "agent.mode=inline needs agent.fn ('package.module:function' or "
               "'path/to/file.py:function')")
        _check(self.mode != "subprocess" or bool(self.command),
               "agent.mode=subprocess needs agent.command (a list: program and arguments)")
        _check(self.mode != "online" or bool(self.admin_key),
               "agent.mode=online needs agent.admin_key: the key outside clients use to start "
               "sessions")


@dataclass(kw_only=True)
class SaverConfig:
    """HF-format weights under <run>/checkpoints/step<N>/ (None disables a trigger)."""

    # Save every this many training steps.
    freq_steps: Optional[int] = None
    # Save every this many epochs (passes over train_dataset).
    freq_epochs: Optional[int] = None
    # Save at the end of the first step this many seconds after the last save (or the start).
    freq_secs: Optional[float] = None


@dataclass(kw_only=True)
class RecoverConfig:
    # disabled: start fresh. auto: resume from <run>/recover/ if a checkpoint is there.
    # resume: resume, and fail if there is none.
    mode: Literal["disabled", "auto", "resume"] = "disabled"
    # Write a recover checkpoint every this many training steps (mode auto or resume only).
    freq_steps: Optional[int] = None
    # Write a recover checkpoint every this many epochs (passes over train_dataset).
    freq_epochs: Optional[int] = None
    # Write a recover checkpoint at the end of the first step this many seconds after
    # the last one (or the start).
    freq_secs: Optional[float] = 3600.0


@dataclass(kw_only=True)
class EvaluatorConfig:
    """Greedy evaluation on valid_dataset (before training, every freq_steps, after)."""

    # Evaluate every this many training steps.
    freq_steps: Optional[int] = None
    # Evaluate every this many epochs (passes over train_dataset).
    freq_epochs: Optional[int] = None
    # Evaluate at the end of the first step this many seconds after the last evaluation (or
    # the start).
    freq_secs: Optional[float] = None
    # Evaluate the starting weights, beside the first step (not when resuming).
    before_training: bool = True
    # Evaluate the final weights after the last step.
    after_training: bool = True
    max_new_tokens: Optional[int] = None  # None: gconfig.max_new_tokens
    # Items an evaluation keeps in flight at most. None: a server's batch
    # (local_engine.max_batch_size; beside training, what the rollout leaves of it). Agent
    # sessions of many turns each on a slow machine finish within agent.timeout only if
    # few run at once.
    max_concurrent: Optional[int] = None

    def __post_init__(self) -> None:
        _check(self.max_concurrent is None or self.max_concurrent >= 1,
               f"evaluator.max_concurrent must be >= 1 or null, got {self.max_concurrent}")


@dataclass(kw_only=True)
class HealthConfig:
    """Warnings while the run goes that it cannot learn: flat or constant rewards, answers
    cut at gconfig.max_new_tokens, a reward function that raises (controller/health.py)."""

    enabled: bool = True  # false: no checks, no warnings
    # Consecutive steps a condition must hold before its warning (once per condition). A
    # reward function raising for most episodes warns at its first step.
    steps: int = 3

    def __post_init__(self) -> None:
        _check(self.steps >= 1, f"health.steps must be >= 1, got {self.steps}; "
               "turn the checks off with health.enabled=false")


WandBMode = Literal["disabled", "online", "offline", "shared"]
SwanlabMode = Literal["disabled", "cloud", "local", "offline"]
_WANDB_MODES: tuple[str, ...] = WandBMode.__args__  # type: ignore[attr-defined]
_SWANLAB_MODES: tuple[str, ...] = SwanlabMode.__args__  # type: ignore[attr-defined]


@dataclass(kw_only=True)
class WandBConfig:
    """Weights & Biases (AReaL's keys). `offline` writes <run>/wandb/ with no network and
    no account (`wandb sync` uploads it later); `online` and `shared` go to the server."""

    # disabled: no W&B run; otherwise wandb.init's mode (see above).
    mode: WandBMode = "disabled"
    # The W&B team or user the run goes to (wandb.init's entity); None: the account's default.
    entity: Optional[str] = None
    project: Optional[str] = None  # None: experiment_name
    name: Optional[str] = None  # None: trial_name
    # wandb.init's job_type: a label of the run's kind, to filter runs by.
    job_type: Optional[str] = None
    # wandb.init's group: runs of one group are shown together.
    group: Optional[str] = None
    # wandb.init's notes: a description of the run.
    notes: Optional[str] = None
    # wandb.init's tags: labels to filter runs by (empty: none).
    tags: list[str] = field(default_factory=list)
    # Appended to the generated run id; a resumed run keeps its id (<run>/wandb/run_id).
    id_suffix: Optional[str] = "train"

    def __post_init__(self) -> None:
        _check(self.mode in _WANDB_MODES, f"stats_logger.wandb.mode must be one of "
               f"{', '.join(_WANDB_MODES)}; got {self.mode!r}")


@dataclass(kw_only=True)
class SwanlabConfig:
    """SwanLab (AReaL's keys). `offline` writes <logdir> with no network and no account
    (`swanlab sync` uploads it later); `local` is SwanLab's local dashboard; `cloud` uploads."""

    # disabled: no SwanLab run; otherwise swanlab.init's mode (see above).
    mode: SwanlabMode = "disabled"
    project: Optional[str] = None  # None: experiment_name
    name: Optional[str] = None  # None: trial_name
    logdir: Optional[str] = None  # None: <run>/swanlab
    # Used by `cloud` only; e.g. ${oc.env:SWANLAB_API_KEY}. Never sent to the tracker.
    api_key: Optional[str] = None

    def __post_init__(self) -> None:
        _check(self.mode in _SWANLAB_MODES, f"stats_logger.swanlab.mode must be one of "
               f"{', '.join(_SWANLAB_MODES)}; got {self.mode!r}")


@dataclass(kw_only=True)
class StatsLoggerConfig:
    jsonl: bool = True  # <run>/stats.jsonl
    tensorboard: bool = True  # <run>/tensorboard/
    # A tqdm bar of the training steps on stderr.
    progress_bar: bool = True
    plot: bool = True  # <run>/reward_curve.png at the end
    # Experiment trackers; each needs `pip install 'asyncrl[track]'` unless disabled.
    wandb: WandBConfig = field(default_factory=WandBConfig)
    swanlab: SwanlabConfig = field(default_factory=SwanlabConfig)


@dataclass(kw_only=True)
class ExperimentConfig:
    # The folder of this experiment's runs, <cluster.fileroot>/<experiment_name>/, and the
    # trackers' default project.
    experiment_name: str = "asyncrl"
    # This run's folder in it, <cluster.fileroot>/<experiment_name>/<trial_name>/, and the
    # trackers' default run name.
    trial_name: str = "trial0"
    # Seeds the trainer's random weights (init_from_scratch, a critic's head), the order of
    # train_dataset, each item's sampling seed (rollout.seeded_sampling) and server i's seed
    # (seed + i).
    seed: int = 1
    # Passes over train_dataset, each of (its items // rollout.consumer_batch_size) steps; the
    # run stops after them or after total_train_steps, whichever comes first.
    total_train_epochs: int = 1
    total_train_steps: Optional[int] = None  # stop earlier than the epochs allow
    tokenizer_path: str = "${actor.path}"  # the tokenizer of prompts and completions
    # AReaL's "<backend>:d<N>t<T>+fsdp:d<M>t<S>", e.g. "vllm:d2+fsdp:d1": N servers of T
    # GPUs each, M x S trainer ranks (M data x S tensor parallel; t1 may be left out); e<E>
    # on either side splits an MoE model's experts (fsdp:d<M>e<E>: M x E ranks). It
    # sets rollout.backend and rollout.n_servers and actor.backend, which may then only
    # repeat it. With "|" instead of "+" ("local:d1|fsdp:d1") servers and trainer ranks
    # share the same GPUs: one GPU runs the whole run (config/allocation.py,
    # docs/guides/gpus-and-clusters.md). null: from rollout.backend and actor.backend when
    # either gives a layout (filled in when loaded, with "+"), else one local server and one
    # rank.
    allocation_mode: Optional[str] = None
    # The machines: nodes, GPUs per node, where runs are written.
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    # Who starts the run's processes, where each part runs, and their CPU cores.
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    ray: RayConfig = field(default_factory=RayConfig)  # scheduler.type=ray
    slurm: SlurmConfig = field(default_factory=SlurmConfig)  # scheduler.type=slurm
    # Generation: the staleness bound, the inference servers and the requests sent to them.
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    local_engine: LocalEngineConfig = field(default_factory=LocalEngineConfig)
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)
    # The trained policy: its model, optimiser, loss, rewards and advantages, weight updates.
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)  # used only when actor.kl_ctl > 0
    critic: Optional[CriticConfig] = None  # PPO with a value model; `critic: {}` for defaults
    teacher: TeacherConfig = field(default_factory=TeacherConfig)  # actor.distill_coef > 0
    # What one episode is (rlvr or agent), its reward and prompt.
    workflow: WorkflowConfig = field(default_factory=WorkflowConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)  # workflow.type=agent only
    # The items trained on (none with agent.mode=online: clients bring them).
    train_dataset: DatasetConfig = field(default_factory=DatasetConfig)
    # Held-out items for the evaluator (those whose question is also a training question are
    # dropped); null: no evaluation.
    valid_dataset: Optional[DatasetConfig] = None
    # More held-out sets (MATH-500 beside AIME, ...), each with valid_dataset's keys, all
    # evaluated with valid_dataset as one set, by workflow.reward_fn. Items keep their task
    # (a JSONL file's default: its name, or its folder's for <split>.jsonl), and a set of
    # several tasks is also scored task by task (eval/task/<task>/reward).
    extra_valid_datasets: list[DatasetConfig] = field(default_factory=list)
    saver: SaverConfig = field(default_factory=SaverConfig)
    # Checkpoints of the whole run state in <run>/recover/, to resume an interrupted run.
    recover: RecoverConfig = field(default_factory=RecoverConfig)
    evaluator: EvaluatorConfig = field(default_factory=EvaluatorConfig)
    # Where each step's stats go: <run>/stats.jsonl, TensorBoard, the progress bar, trackers.
    stats_logger: StatsLoggerConfig = field(default_factory=StatsLoggerConfig)
    # Warnings that the run cannot learn, in the log and the final summary.
    health: HealthConfig = field(default_factory=HealthConfig)

    def __post_init__(self) -> None:
        _check(self.total_train_epochs >= 1, f"total_train_epochs must be >= 1, got {self.total_train_epochs}")
        _check(self.total_train_steps is None or self.total_train_steps >= 1,
               f"total_train_steps must be >= 1 or null, got {self.total_train_steps}")
        _check(self.cluster.n_nodes >= 1, f"cluster.n_nodes must be >= 1, got {self.cluster.n_nodes}")
        _check(self.cluster.n_nodes == 1 or self.scheduler.type != "local",
               f"cluster.n_nodes={self.cluster.n_nodes} but scheduler.type=local runs on one "
               "machine; set cluster.n_nodes=1 or scheduler.type=ray|slurm")
        self._resolve_allocation()
        self._check_weight_update()
        self._check_lora()
        self._check_routing_replay()
        _check(self.scheduler.trainer != "inline" or
               (self.trainer_world_size == 1 and self.scheduler.type == "local"),
               f"scheduler.trainer=inline runs one trainer rank in this process under the local "
               f"scheduler, but allocation_mode={self.allocation_mode!r} and "
               f"scheduler.type={self.scheduler.type}; use scheduler.trainer=service or auto")
        _check(bool(self.train_dataset.path) or self.online,
               "train_dataset.path is empty: give a JSONL file or folder, an HF dataset id, "
               "reasoning_gym:<task> or python:<module>:<function>")
        _check(self.valid_dataset is not None or not self.extra_valid_datasets,
               "extra_valid_datasets is set but valid_dataset is null: give the first held-out "
               "set as valid_dataset, or drop extra_valid_datasets")
        for i, extra in enumerate(self.extra_valid_datasets):
            _check(bool(extra.path), f"extra_valid_datasets[{i}].path is empty: give a JSONL "
                   "file or folder, an HF dataset id, reasoning_gym:<task> or "
                   "python:<module>:<function>")
        self._check_agent()
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

    @property
    def valid_datasets(self) -> list[DatasetConfig]:
        """Every held-out set: valid_dataset, then extra_valid_datasets."""
        return [self.valid_dataset, *self.extra_valid_datasets] if self.valid_dataset else []

    @property
    def online(self) -> bool:
        """Episodes come from outside clients (agent.mode=online), not from a dataset."""
        return self.workflow.type == "agent" and self.agent.mode == "online"

    def _check_agent(self) -> None:
        if self.workflow.type != "agent":
            return
        self.agent.check_mode()
        _check(self.valid_dataset is None or not self.online,
               "agent.mode=online takes its episodes from outside clients and has no held-out "
               "set to evaluate; drop valid_dataset and extra_valid_datasets")
        _check(not self.online or self.total_train_steps is not None,
               "agent.mode=online has no dataset epochs; set total_train_steps")
        _check(not self.online or self.actor.reward_norm is None
               or self.actor.reward_norm.mean_level != "group",
               "agent.mode=online: each session is its own group, so actor.reward_norm."
               "mean_level=group makes every advantage 0; use agent.baseline with "
               "reward_norm.mean_level none or batch")

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
        """allocation_mode, or the layouts in rollout.backend and actor.backend, decide the
        servers and the trainer mesh; every spelling given must agree; and the GPUs must
        hold them (NCCL refuses two trainer ranks on one GPU)."""
        gpus = self.cluster.n_gpus_per_node * self.cluster.n_nodes
        _check(gpus > 0 or self.rollout.gpu_memory_fraction is None,
               f"rollout.gpu_memory_fraction={self.rollout.gpu_memory_fraction} is for GPU "
               "servers but cluster.n_gpus_per_node=0 (a CPU machine); drop it, or set "
               "cluster.n_gpus_per_node")
        alloc = self._merged_allocation()
        if alloc is None:
            self.rollout.backend = self.rollout.backend or "local"
            self.rollout.n_servers = self.rollout.n_servers or 1
            return
        self.allocation_mode, self.actor.backend = alloc.mode, alloc.train_part
        self.rollout.backend, self.rollout.n_servers = alloc.backend, alloc.n_servers
        self._check_tensor_parallel(alloc)
        mode, world = self.allocation_mode, alloc.trainer_world_size
        if gpus and alloc.colocated:
            _check(world <= gpus,
                   f"allocation_mode={mode!r} puts {world} trainer ranks on "
                   f"cluster.n_nodes x cluster.n_gpus_per_node = {gpus} GPU(s), and NCCL "
                   f"refuses two ranks on one GPU; use at most d{gpus} on both sides "
                   f"('{alloc.backend}:d{gpus}|fsdp:d{gpus}') or more GPUs")
            _check(self.scheduler.type == "local",
                   f"allocation_mode={mode!r} shares GPUs between servers and trainer ranks, "
                   f"which scheduler.type=local places (not {self.scheduler.type}); use "
                   "scheduler.type=local, or '+' for separate GPUs")
            if self.rollout.gpu_memory_fraction is None:
                self.rollout.gpu_memory_fraction = 0.5
        elif gpus:
            hint = (f"; to have servers and trainer ranks share {gpus} GPU(s), use "
                    f"'{alloc.backend}:d{min(gpus, world)}|fsdp:d{min(gpus, world)}'"
                    if alloc.server_gpus + world > gpus and alloc.server_tensor_size == 1
                    and alloc.trainer_tensor_size == 1 and alloc.trainer_expert_size == 1 else "")
            _check(alloc.server_gpus + world <= gpus,
                   f"allocation_mode={mode!r} needs {alloc.server_gpus} inference + "
                   f"{world} trainer GPUs but cluster.n_nodes x "
                   f"cluster.n_gpus_per_node = {gpus}{hint}")

    def _merged_allocation(self) -> Allocation | None:
        """The one layout of allocation_mode, rollout.backend / n_servers and actor.backend;
        None when none of them gives one. A key that contradicts another is an error naming
        both."""
        rollout, actor = self.rollout, self.actor
        backend, servers, server_tp, server_ep = (
            parse_rollout_backend(rollout.backend) if rollout.backend is not None
            else (None, None, 1, 1))
        _check(servers is None or rollout.n_servers in (None, servers),
               f"rollout.n_servers={rollout.n_servers} contradicts rollout.backend="
               f"{rollout.backend!r} (which means {servers} servers); drop rollout.n_servers "
               "or make them agree")
        servers = servers or rollout.n_servers
        train = parse_train_backend(actor.backend) if actor.backend is not None else None
        if self.allocation_mode is None:
            if train is None and server_tp == 1 and ":" not in (rollout.backend or ""):
                return None  # no layout given: the defaults
            data, tensor, expert = train or (1, 1, 1)
            return parse_allocation_mode(
                f"{backend or 'local'}:d{servers or 1}t{server_tp}e{server_ep}"
                f"+fsdp:d{data}t{tensor}e{expert}")
        alloc = parse_allocation_mode(self.allocation_mode)
        mode = self.allocation_mode
        for key, have, want in (("backend", backend, alloc.backend),
                                ("n_servers", servers, alloc.n_servers)):
            shown = getattr(rollout, key)
            _check(have is None or have == want,
                   f"rollout.{key}={shown} contradicts allocation_mode={mode!r} "
                   f"(which means {want}); drop rollout.{key} or make them agree")
        _check(":" not in (rollout.backend or "")
               or (server_tp, server_ep) == (alloc.server_tensor_size, alloc.server_expert_size),
               f"rollout.backend={rollout.backend!r} contradicts allocation_mode={mode!r} "
               f"(inference part {alloc.rollout_part}); drop one or make them agree")
        _check(train is None or train == (alloc.trainer_data_size, alloc.trainer_tensor_size,
                                          alloc.trainer_expert_size),
               f"actor.backend={actor.backend!r} contradicts allocation_mode={mode!r} "
               f"(training part {alloc.train_part}); drop one or make them agree")
        return alloc

    def _check_tensor_parallel(self, alloc: Allocation) -> None:
        """What a tensor size above 1 needs: a backend and devices that split a model."""
        t = alloc.server_tensor_size
        if t > 1:
            where = f"rollout tensor parallel t{t} (allocation_mode={self.allocation_mode!r})"
            _check(alloc.backend != "local",
                   f"{where}: our local engine runs each server on one device; use "
                   "rollout.backend vllm or sglang, or t1")
            _check(self.cluster.n_gpus_per_node > 0,
                   f"{where} splits each server over GPUs, but cluster.n_gpus_per_node=0 (a "
                   "CPU machine); use t1 on the CPU, or set cluster.n_gpus_per_node")
        _check(alloc.trainer_tensor_size == 1 or not self.actor.shared_prefix,
               f"actor.shared_prefix=true runs the trie attention, which tensor parallel "
               f"training (actor.backend={alloc.train_part!r}) does not; set "
               "actor.shared_prefix=false, or t1")

    @property
    def colocated(self) -> bool:
        """Servers and trainer ranks share GPUs (allocation_mode with '|', on GPUs)."""
        alloc = self.allocation
        return self.cluster.n_gpus_per_node > 0 and alloc is not None and alloc.colocated

    def _check_weight_update(self) -> None:
        """What each actor.weight_update_mode needs of the placement."""
        mode, backend = self.actor.weight_update_mode, self.rollout.backend
        key = f"actor.weight_update_mode={mode}"
        if mode == "broadcast":
            # The group has one rank per server; a tensor-parallel server has T workers.
            _check(self.server_tensor_size == 1,
                   f"{key}: the weight-update group takes one rank per server, but each "
                   f"server of allocation_mode={self.allocation_mode!r} is "
                   f"{self.server_tensor_size} tensor-parallel workers; use "
                   "actor.weight_update_mode=disk")
            # Ours receives over gloo (CPU buffers); vLLM and SGLang on GPUs over NCCL.
            _check(not (self.colocated and backend != "local"),
                   f"{key} with allocation_mode={self.allocation_mode!r}: {backend} receives "
                   "the broadcast over NCCL, which refuses two ranks (trainer rank 0 and "
                   "server 0) on one GPU; use actor.weight_update_mode=ipc or disk")
            return
        if mode != "ipc":
            return
        _check(self.cluster.n_gpus_per_node > 0,
               f"{key} shares GPU memory by CUDA IPC, which a CPU machine "
               "(cluster.n_gpus_per_node=0) has not; use actor.weight_update_mode=disk")
        _check(backend in ("local", "vllm"),
               f"{key}: the {backend} backend has no IPC weight update here; use "
               "rollout.backend local or vllm, or actor.weight_update_mode=disk")
        alloc = self.allocation
        _check(alloc is not None and alloc.colocated and alloc.n_gpus == 1,
               f"{key} hands trainer rank 0's weights to a server on the same GPU: use "
               f"allocation_mode='{backend}:d1|fsdp:d1' (got {self.allocation_mode!r}), or "
               "actor.weight_update_mode=disk")
        _check(self.scheduler.router != "service" and self.scheduler.weight_update != "service",
               f"{key} runs from the controller's own client: set scheduler.router and "
               "scheduler.weight_update to inline or auto")

    def _check_lora(self) -> None:
        """What actor.use_lora needs of the servers: adapter folders, by disk."""
        if not self.actor.use_lora:
            return
        _check(self.actor.weight_update_mode == "disk",
               f"actor.use_lora=true publishes the adapters alone, as a folder each server "
               f"loads beside its base; actor.weight_update_mode="
               f"{self.actor.weight_update_mode} sends full weights. Set "
               "actor.weight_update_mode=disk")
        _check(self.rollout.backend != "vllm" or self.actor.lora_rank <= 512,
               f"actor.lora_rank={self.actor.lora_rank}: vLLM serves LoRA ranks up to 512; "
               "choose a smaller rank or rollout.backend=local")

    def _check_routing_replay(self) -> None:
        """actor.routing_replay needs servers that return each token's experts: ours, or
        SGLang's through the controller's own client (which asks for them)."""
        if not self.actor.routing_replay:
            return
        backend = self.rollout.backend
        _check(backend in ("local", "sglang"),
               f"actor.routing_replay=true needs each token's routed experts from the servers; "
               f"asyncrl reads them from the local and sglang backends, not {backend}; use "
               "one of those or set actor.routing_replay=false")
        router = self.scheduler.router
        inline = router == "inline" or (router == "auto" and self.scheduler.type == "local")
        _check(backend != "sglang" or inline,
               f"actor.routing_replay=true with sglang: the controller's own client asks the "
               f"servers for routed experts, and scheduler.router={router} (scheduler.type="
               f"{self.scheduler.type}) routes through a router process; set "
               "scheduler.router=inline")

    @property
    def allocation(self) -> Allocation | None:
        """The parsed allocation_mode (set whenever a layout was given); None: the defaults."""
        return None if self.allocation_mode is None else parse_allocation_mode(
            self.allocation_mode)

    @property
    def trainer_world_size(self) -> int:
        """Trainer ranks: allocation_mode's fsdp:d<M>t<S>, M x S; else 1."""
        alloc = self.allocation
        return 1 if alloc is None else alloc.trainer_world_size

    @property
    def server_tensor_size(self) -> int:
        """GPUs of each inference server (allocation_mode's t of the inference part)."""
        alloc = self.allocation
        return 1 if alloc is None else alloc.server_tensor_size

    @property
    def server_expert_size(self) -> int:
        """GPUs of each inference server that split the experts (the e of the inference
        part)."""
        alloc = self.allocation
        return 1 if alloc is None else alloc.server_expert_size
