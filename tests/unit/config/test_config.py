"""Config loading: YAML + overrides, interpolation, errors that name the key."""

from pathlib import Path

import pytest

from asyncrl.config import ConfigError, ExperimentConfig, load_config
from asyncrl.config.offline import TRAINER_SCHEMAS

REPO = Path(__file__).resolve().parents[3]

BASE = """
experiment_name: t
gconfig:
  n_samples: 4
train_dataset:
  path: reasoning_gym:basic_arithmetic
  batch_size: 8
rollout:
  consumer_batch_size: ${train_dataset.batch_size}
  max_head_offpolicyness: 2
actor:
  reward_norm:
    mean_level: group
    std_level: group
    group_size: ${gconfig.n_samples}
"""


@pytest.fixture
def base_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(BASE)
    return path


def test_yaml_overrides_and_interpolation(base_yaml):
    cfg = load_config(base_yaml, ["train_dataset.batch_size=16", "gconfig.n_samples=8"])
    assert cfg.rollout.consumer_batch_size == 16
    assert cfg.actor.reward_norm.group_size == 8
    assert cfg.rollout.max_head_offpolicyness == 2
    assert cfg.rollout.concurrency == 16 * 3  # B * (eta + 1) when not set


def test_typo_in_key_suggests_the_nearest_valid_key(base_yaml):
    with pytest.raises(ConfigError, match=r"rollout.max_head_offpolicynes'.*did you mean "
                                          r"'rollout.max_head_offpolicyness'"):
        load_config(base_yaml, ["rollout.max_head_offpolicynes=1"])
    with pytest.raises(ConfigError, match=r"'actor.optimzer'.*did you mean 'actor.optimizer'"):
        load_config(base_yaml, ["actor.optimzer.lr=1e-5"])


def test_typo_in_yaml_file_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(BASE + "gconfig_:\n  n_samples: 2\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'gconfig_' \(from .*bad.yaml\); "
                                          r"did you mean 'gconfig'"):
        load_config(path)


def test_bad_values_name_the_key(base_yaml):
    with pytest.raises(ConfigError, match="gconfig.n_samples"):
        load_config(base_yaml, ["gconfig.n_samples=many"])
    with pytest.raises(ConfigError, match=r"actor.dtype.*bfloat16"):
        load_config(base_yaml, ["actor.dtype=fp8"])
    with pytest.raises(ConfigError, match="max_head_offpolicyness must be >= 0"):
        load_config(base_yaml, ["rollout.max_head_offpolicyness=-1"])


def test_inconsistent_group_size_says_what_to_set(base_yaml):
    with pytest.raises(ConfigError, match=r"group_size=3 but gconfig.n_samples=4"):
        load_config(base_yaml, ["actor.reward_norm.group_size=3"])


def test_group_size_defaults_to_n_samples(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train_dataset:\n  path: x.jsonl\ngconfig:\n  n_samples: 6\n")
    assert load_config(path).actor.reward_norm.group_size == 6


def test_malformed_override_is_explained(base_yaml):
    with pytest.raises(ConfigError, match="not of the form key=value"):
        load_config(base_yaml, ["rollout.max_head_offpolicyness"])


def test_missing_dataset_path_is_explained(tmp_path):
    with pytest.raises(ConfigError, match="train_dataset.path is empty"):
        load_config(None, [])


def test_extra_valid_datasets_follow_valid_dataset(base_yaml, tmp_path):
    extra = ("extra_valid_datasets=[{path: math.jsonl}, "
             "{path: 'reasoning_gym:chain_sum', size: 4, seed: 9}]")
    cfg = load_config(base_yaml, ["valid_dataset.path=aime.jsonl", extra])
    assert [(d.path, d.size, d.seed) for d in cfg.valid_datasets] == [
        ("aime.jsonl", None, 0), ("math.jsonl", None, 0), ("reasoning_gym:chain_sum", 4, 9)]
    assert load_config(base_yaml, []).valid_datasets == []
    with pytest.raises(ConfigError, match="extra_valid_datasets is set but valid_dataset is "
                                          "null: give the first held-out set as valid_dataset"):
        load_config(base_yaml, [extra])
    with pytest.raises(ConfigError, match=r"extra_valid_datasets\[1\]\.path is empty"):
        load_config(base_yaml, ["valid_dataset.path=a.jsonl",
                                "extra_valid_datasets=[{path: b.jsonl}, {size: 3}]"])
    with pytest.raises(ConfigError, match="unknown config key 'sise' .*did you mean 'size'"):
        load_config(base_yaml, ["valid_dataset.path=a.jsonl",
                                "extra_valid_datasets=[{path: b.jsonl, sise: 3}]"])


@pytest.mark.parametrize("path", sorted(
    list((REPO / "examples").rglob("*.yaml")) + list((REPO / "src/asyncrl/recipes").glob("*.yaml"))),
    ids=lambda p: p.name)
def test_every_shipped_config_loads(path, monkeypatch):
    monkeypatch.setenv("ASYNCRL_ADMIN_KEY", "admin-key-for-the-test")  # online examples
    # examples/<trainer>/ or a name with _<trainer>_ (examples/vlm/shapes_sft_cpu.yaml) for
    # the offline trainers (sft, dpo, rm); RL configs otherwise.
    schema = TRAINER_SCHEMAS.get(path.parent.name) or next(
        (s for name, s in TRAINER_SCHEMAS.items() if f"_{name}_" in f"_{path.stem}_"),
        ExperimentConfig)
    cfg = load_config(path, schema=schema)
    assert cfg.train_dataset.path or cfg.online


def test_an_online_config_needs_its_admin_key_from_the_environment(monkeypatch):
    monkeypatch.delenv("ASYNCRL_ADMIN_KEY", raising=False)
    with pytest.raises(ConfigError, match="ASYNCRL_ADMIN_KEY"):
        load_config(REPO / "examples/agents/online/online_cpu.yaml")


@pytest.mark.parametrize("overrides, message", [
    (["workflow.type=agent"], "agent.mode=inline needs agent.fn"),
    (["workflow.type=agent", "agent.mode=subprocess"], "needs agent.command"),
    (["workflow.type=agent", "agent.mode=online"], "needs agent.admin_key"),
    (["workflow.type=agent", "agent.mode=online", "agent.admin_key=kkk"],
     "set total_train_steps"),
    (["workflow.type=agent", "agent.fn=a:b", "agent.turn_discount=0"], "agent.turn_discount"),
    (["rollout.max_session_version_lag=-1"], "max_session_version_lag must be >= 0"),
])
def test_agent_config_errors_say_what_to_set(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["train_dataset.path=x", *overrides])


def test_several_nodes_with_the_local_scheduler_is_explained(base_yaml):
    with pytest.raises(ConfigError, match="cluster.n_nodes=2 but scheduler.type=local"):
        load_config(base_yaml, ["cluster.n_nodes=2"])


def test_algorithm_options_load_and_fill_the_overlong_budget(base_yaml):
    cfg = load_config(base_yaml, [
        "gconfig.max_new_tokens=64", "actor.overlong_reward_penalty=true", "actor.overlong_tokens=16",
        "actor.c_clip=3.0", "actor.loss_agg_mode=seq-mean-token-mean",
        "actor.importance_sampling_level=sequence", "actor.reward_norm.mean_leave1out=true",
        "actor.reward_norm.std_unbiased=true", "actor.reward_clip=5"])
    assert cfg.actor.max_new_tokens == 64
    assert cfg.actor.reward_norm.mean_leave1out and cfg.actor.reward_norm.std_unbiased
    assert cfg.actor.c_clip == 3.0 and cfg.actor.loss_agg_mode == "seq-mean-token-mean"


@pytest.mark.parametrize("override, message", [
    ("actor.c_clip=1.0", "actor.c_clip must be > 1"),
    ("actor.loss_agg_mode=seq-sum", "actor.loss_agg_mode"),
    ("actor.importance_sampling_level=group", "actor.importance_sampling_level"),
    ("actor.reward_clip=0", "actor.reward_clip must be > 0"),
    ("actor.overlong_penalty_factor=-1", "actor.overlong_penalty_factor must be >= 0"),
    ("actor.overlong_reward_penalty=true", "needs actor.overlong_tokens >= 1"),
    ("actor.reward_norm.eps=-1", "actor.reward_norm.eps must be >= 0"),
])
def test_bad_algorithm_options_name_the_key(base_yaml, override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(base_yaml, [override])


def test_overlong_window_longer_than_the_budget_is_explained(base_yaml):
    with pytest.raises(ConfigError, match="actor.overlong_tokens=300 exceeds gconfig.max_new_tokens=256"):
        load_config(base_yaml, ["actor.overlong_reward_penalty=true", "actor.overlong_tokens=300"])


def test_leave_one_out_with_one_sample_per_prompt_is_explained(base_yaml):
    with pytest.raises(ConfigError, match="mean_leave1out=true needs groups of at least 2"):
        load_config(base_yaml, ["gconfig.n_samples=1", "actor.reward_norm.mean_leave1out=true"])


def test_actor_max_new_tokens_must_agree_with_gconfig(base_yaml):
    with pytest.raises(ConfigError, match="actor.max_new_tokens=32 but gconfig.max_new_tokens=256"):
        load_config(base_yaml, ["actor.max_new_tokens=32"])


def test_lora_keys_load_into_the_actor_and_its_engine_spec(base_yaml):
    from asyncrl.config.engine import TrainEngineSpec

    cfg = load_config(base_yaml, ["actor.use_lora=true", "actor.lora_rank=8",
                                  "actor.lora_alpha=32", "actor.target_modules=[q_proj,v_proj]"])
    spec = TrainEngineSpec.of(cfg.actor)
    assert (spec.use_lora, spec.lora_rank, spec.lora_alpha) == (True, 8, 32)
    assert spec.target_modules == ("q_proj", "v_proj") and spec.peft_type == "lora"
    assert load_config(base_yaml).actor.target_modules == ["all-linear"]


@pytest.mark.parametrize("overrides, message", [
    (["actor.peft_type=ia3"], r"actor.peft_type must be 'lora'.*got 'ia3'"),
    (["actor.lora_rank=0"], r"actor.lora_rank must be >= 1"),
    (["actor.lora_alpha=0"], r"actor.lora_alpha must be > 0"),
    (["actor.target_modules=[]"], r"actor.target_modules must be a non-empty list"),
    (["actor.target_modules=[all-linear,q_proj]"], r"'all-linear' already names"),
    (["actor.use_lora=true", "actor.init_from_scratch=true"],
     r"init_from_scratch=true would train adapters on random weights"),
    (["actor.use_lora=true", "actor.weight_update_mode=broadcast"],
     r"actor.use_lora=true publishes the adapters alone.*weight_update_mode=disk"),
    (["actor.use_lora=true", "rollout.backend=vllm", "actor.lora_rank=1024"],
     r"actor.lora_rank=1024: vLLM serves LoRA ranks up to 512"),
])
def test_bad_lora_options_name_the_key(base_yaml, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(base_yaml, overrides)


@pytest.mark.parametrize("backend", ["local", "vllm", "sglang"])
def test_a_lora_run_loads_with_each_rollout_backend(base_yaml, backend):
    cfg = load_config(base_yaml, ["actor.use_lora=true", f"rollout.backend={backend}"])
    assert cfg.actor.use_lora and cfg.rollout.backend == backend


@pytest.mark.parametrize("overrides, message", [
    (["rollout.backend=vllm"], "reads them from the local and sglang backends, not vllm"),
    (["rollout.backend=sglang", "scheduler.type=ray"],
     r"scheduler.router=auto \(scheduler.type=ray\) routes through a router process"),
])
def test_routing_replay_needs_servers_whose_routes_asyncrl_reads(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["train_dataset.path=x", "actor.routing_replay=true", *overrides])


def test_routing_replay_from_sglang_loads_with_the_controller_s_own_client():
    cfg = load_config(None, ["train_dataset.path=x", "actor.routing_replay=true",
                             "rollout.backend=sglang", "scheduler.type=ray",
                             "scheduler.router=inline"])
    assert cfg.actor.routing_replay and cfg.rollout.backend == "sglang"
