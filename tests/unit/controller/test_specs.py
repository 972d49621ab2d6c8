"""Each process's spec: built from the run's config, written to its file, read back equal;
a spec file with a missing, unknown or mistyped key fails naming it."""

import json
from pathlib import Path

import pytest

from asyncrl.agents import service as agent_service
from asyncrl.agents.service import AgentServiceSpec
from asyncrl.config import ConfigError, load_config
from asyncrl.config.specfile import read_spec, spec_to_dict, write_spec
from asyncrl.controller import weight_update
from asyncrl.controller.specs import (
    build_agent_spec,
    build_trainer_spec,
    build_weight_update_spec,
)
from asyncrl.controller.weight_update import WeightUpdateSpec
from asyncrl.trainer import service as trainer_service
from asyncrl.trainer.worker import TrainerSpec

REPO = Path(__file__).resolve().parents[3]
# The offline trainers' configs (no RL processes): under examples/<trainer>/, or named
# with _<trainer>_ elsewhere (examples/vlm/shapes_sft_cpu.yaml), as test_config.py reads them.
OFFLINE = ("sft", "dpo", "rm")
RL_CONFIGS = sorted(p for p in [*(REPO / "examples").rglob("*.yaml"),
                                *(REPO / "src/asyncrl/recipes").glob("*.yaml")]
                    if p.parent.name not in OFFLINE
                    and not any(f"_{name}_" in f"_{p.stem}_" for name in OFFLINE))


def _specs(cfg):
    return [(TrainerSpec, build_trainer_spec(cfg)), (AgentServiceSpec, build_agent_spec(cfg)),
            (WeightUpdateSpec, build_weight_update_spec(cfg, "/runs/e/t/weights"))]


@pytest.mark.parametrize("path", RL_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_configs_specs_round_trip_through_their_files(path, tmp_path,
                                                                     monkeypatch):
    monkeypatch.setenv("ASYNCRL_ADMIN_KEY", "admin-key-for-the-test")  # online examples
    cfg = load_config(path)
    for cls, spec in _specs(cfg):
        file = write_spec(spec, tmp_path / f"{cls.__name__}.json")
        assert read_spec(cls, file) == spec
        assert set(json.loads(file.read_text())) == set(spec_to_dict(spec))


def test_the_quickstart_trainer_spec_holds_the_recipes_values(tmp_path):
    cfg = load_config(REPO / "src/asyncrl/recipes/quickstart.yaml",
                      [f"cluster.fileroot={tmp_path}"])
    spec = read_spec(TrainerSpec, write_spec(build_trainer_spec(cfg), tmp_path / "t.json"))
    # The recipe's own values, as its YAML says (and the group size filled from n_samples).
    assert spec.actor.path == "smollm2-135m-instruct" and spec.critic is None
    assert spec.actor.reward_norm.group_size == cfg.gconfig.n_samples == 4
    assert spec.actor.max_new_tokens == cfg.gconfig.max_new_tokens
    assert (spec.device, spec.gpu_memory_fraction, spec.fileroot) == ("cpu", None, str(tmp_path))
    assert spec.tokenizer_path == "smollm2-135m-instruct"  # ${actor.path}, resolved


def test_a_colocated_gpu_rank_takes_what_the_server_leaves():
    cfg = load_config(None, ["train_dataset.path=x", "allocation_mode=local:d1|fsdp:d1",
                             "cluster.n_gpus_per_node=1", "rollout.gpu_memory_fraction=0.25"])
    assert build_trainer_spec(cfg).gpu_memory_fraction == 0.75
    assert build_trainer_spec(load_config(None, [
        "train_dataset.path=x", "allocation_mode=local:d1+fsdp:d1",
        "cluster.n_gpus_per_node=2"])).gpu_memory_fraction is None  # a GPU of its own


def _written(tmp_path):
    cfg = load_config(None, ["train_dataset.path=x", "critic={}", "actor.kl_ctl=0.1"])
    file = write_spec(build_trainer_spec(cfg), tmp_path / "trainer.json")
    return file, json.loads(file.read_text())


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("seed"), r"missing key 'seed'"),
    (lambda d: d["actor"]["optimizer"].pop("lr"), r"missing key 'actor\.optimizer\.lr'"),
    (lambda d: d["critic"].pop("mb_spec"), r"missing key 'critic\.mb_spec'"),
    (lambda d: d.update(rollout={}), r"unknown key 'rollout' \(TrainerSpec has actor, "),
    (lambda d: d["actor"].update(lrr=1), r"unknown key 'actor\.lrr'"),
    (lambda d: d.update(seed="one"), r"'seed' must be int, got 'one'"),
    (lambda d: d.update(seed=True), r"'seed' must be int, got True"),
    (lambda d: d.update(device="tpu"), r"'device' must be one of \['cpu', 'cuda'\], got 'tpu'"),
    (lambda d: d["actor"].update(reward_norm=3), r"'actor\.reward_norm' must be a mapping"),
    (lambda d: d["actor"]["optimizer"].update(lr=-1.0), r"optimizer\.lr must be > 0"),
])
def test_a_trainer_spec_file_that_is_not_exact_fails_naming_the_key(tmp_path, change, message):
    file, data = _written(tmp_path)
    change(data)
    file.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=rf"spec file '.*trainer\.json': {message}"):
        read_spec(TrainerSpec, file)


def test_whole_numbers_read_as_floats_and_no_critic_as_null(tmp_path):
    file, data = _written(tmp_path)
    data["actor"]["kl_ctl"], data["critic"] = 1, None
    file.write_text(json.dumps(data))
    spec = read_spec(TrainerSpec, file)
    assert spec.actor.kl_ctl == 1.0 and type(spec.actor.kl_ctl) is float
    assert spec.critic is None


@pytest.mark.parametrize("main, cls, extra", [
    (trainer_service.main, TrainerSpec, []),
    (agent_service.main, AgentServiceSpec, ["--servers", "http://127.0.0.1:1"]),
    (weight_update.main, WeightUpdateSpec, ["--trainer", "http://127.0.0.1:1",
                                            "--servers", "http://127.0.0.1:2"]),
])
def test_each_process_refuses_a_spec_file_with_a_missing_key(tmp_path, capsys, monkeypatch,
                                                             main, cls, extra):
    monkeypatch.setenv("ASYNCRL_ADMIN_KEY", "k")  # the agent service asks for it first
    cfg = load_config(None, ["train_dataset.path=x"])
    [spec] = [s for c, s in _specs(cfg) if c is cls]
    data = spec_to_dict(spec)
    first = min(data)
    data.pop(first)
    file = tmp_path / "spec.json"
    file.write_text(json.dumps(data))
    with pytest.raises(SystemExit) as exit_info:
        main(["--spec", str(file), *extra])
    assert exit_info.value.code == 2
    assert f"missing key '{first}'" in capsys.readouterr().err
