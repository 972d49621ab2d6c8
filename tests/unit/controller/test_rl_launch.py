"""What an RL run asks its scheduler for: the inference and trainer roles, keys, placement."""

from dataclasses import replace
from pathlib import Path

from asyncrl.agents.service import AgentServiceSpec
from asyncrl.config import load_config
from asyncrl.config.specfile import read_spec
from asyncrl.controller.launch import launch
from asyncrl.controller.placement import Placement
from asyncrl.controller.specs import (
    build_agent_spec,
    build_trainer_spec,
    build_weight_update_spec,
    run_paths,
)
from asyncrl.controller.weight_update import WeightUpdateSpec
from asyncrl.launch.base import Worker
from asyncrl.launch.local import rank_cores
from asyncrl.trainer.service import TrainingClient
from asyncrl.trainer.worker import TrainerSpec


class RecordingScheduler:
    """A scheduler that starts nothing: it records the specs and makes up addresses."""

    def __init__(self):
        self.specs = []

    def create_workers(self, spec):
        self.specs.append(spec)
        return [Worker(role=spec.role, index=i, host="10.0.0.9", port=9000 + i,
                       address=f"http://10.0.0.9:{9000 + i}", node_id=f"node{i}", pid=0,
                       log_path="") for i in range(spec.count)]


def _launch(tmp_path, tiny_path, *overrides):
    cfg = load_config(None, [f"cluster.fileroot={tmp_path}", f"actor.path={tiny_path}",
                             "train_dataset.path=unused.jsonl", "scheduler.type=ray",
                             "cluster.n_nodes=2", *overrides])
    scheduler = RecordingScheduler()
    return launch(cfg, run_paths(cfg), scheduler), scheduler.specs


def _spec_file(command):
    return Path(command[command.index("--spec") + 1])


def test_off_the_machine_servers_and_ranks_take_per_run_keys(tmp_path, tiny_path):
    services, specs = _launch(tmp_path, tiny_path, "allocation_mode=local:d2+fsdp:d2",
                              "scheduler.trainer_threads=3")
    # Off the local machine every role is a service: servers, router, ranks, weight update.
    servers, router, ranks, weights = specs
    assert [s.role for s in specs] == ["inference", "router", "trainer", "weight_update"]
    assert servers.role == "inference" and servers.count == 2
    assert servers.env["ASYNCRL_API_KEY"] == services.inference_key
    assert len(services.inference_key) == 32
    assert ranks.role == "trainer" and ranks.count == 2 and ranks.torch_distributed
    assert ranks.cpus == 3 and "asyncrl.trainer.service" in ranks.command
    assert services.placement == Placement(trainer="service", router="service",
                                           agent="inline", weight_update="service")
    # Each service process reads its own spec, written into the run's folder.
    cfg = load_config(None, [f"cluster.fileroot={tmp_path}", f"actor.path={tiny_path}",
                             "train_dataset.path=unused.jsonl", "scheduler.type=ray",
                             "cluster.n_nodes=2", "allocation_mode=local:d2+fsdp:d2",
                             "scheduler.trainer_threads=3"])
    run = Path(tmp_path) / "asyncrl" / "trial0"
    assert _spec_file(ranks.command) == run / "specs" / "trainer.json"
    assert read_spec(TrainerSpec, _spec_file(ranks.command)) == build_trainer_spec(cfg)
    assert _spec_file(weights.command) == run / "specs" / "weight_update.json"
    assert read_spec(WeightUpdateSpec, _spec_file(weights.command)) == \
        build_weight_update_spec(cfg, run / "weights")
    assert "--config" not in ranks.command + weights.command
    assert isinstance(services.trainer, TrainingClient)
    assert services.trainer.api_key == ranks.env["ASYNCRL_API_KEY"] != services.inference_key
    assert services.trainer.addresses == ["http://10.0.0.9:9000", "http://10.0.0.9:9001"]
    assert services.inference == ["http://10.0.0.9:9000", "http://10.0.0.9:9001"]
    # The router guards itself and reaches the servers with their key; the weight-update
    # service has its own key and holds the keys of the ranks and of the router.
    assert router.env == {"ASYNCRL_API_KEY": services.inference_key} and router.cpus == 0
    assert services.router == "http://10.0.0.9:9000"
    assert "--router" in weights.command and "--servers" not in weights.command
    assert weights.env["ASYNCRL_TRAINER_KEY"] == ranks.env["ASYNCRL_API_KEY"]
    assert weights.env["ASYNCRL_INFERENCE_KEY"] == services.inference_key
    assert weights.env["ASYNCRL_API_KEY"] not in (services.inference_key,
                                                  ranks.env["ASYNCRL_API_KEY"])
    assert services.weight_update is not None and weights.cpus == 0


def test_vllm_servers_get_their_key_and_the_weight_transfer_flag(tmp_path, tiny_path):
    services, (servers, *_) = _launch(tmp_path, tiny_path, "allocation_mode=vllm:d1+fsdp:d1",
                                      "actor.weight_update_mode=broadcast")
    at = servers.command.index("--api-key")
    assert servers.command[at + 1] == services.inference_key
    at = servers.command.index("--weight-transfer-config")
    assert servers.command[at + 1] == '{"backend": "nccl"}'


def test_sglang_servers_record_routed_experts_for_routing_replay(tmp_path, tiny_path):
    _, (servers, *_) = _launch(tmp_path, tiny_path, "allocation_mode=sglang:d1+fsdp:d1",
                               "actor.routing_replay=true", "scheduler.router=inline")
    assert "--enable-return-routed-experts" in servers.command
    _, (plain, *_) = _launch(tmp_path, tiny_path, "allocation_mode=sglang:d1+fsdp:d1")
    assert "--enable-return-routed-experts" not in plain.command


def test_the_trainers_cores_split_evenly_or_one_each():
    assert rank_cores([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    assert rank_cores([4, 5, 6], 2) == [[4], [5]]
    assert rank_cores([7], 3) == [[7], [7], [7]]


def test_on_one_cpu_machine_servers_and_the_inline_trainer_share_cores(tmp_path, tiny_path):
    import os

    from asyncrl.api import cores
    from asyncrl.config.schema import SchedulerConfig
    from asyncrl.launch.local import LocalScheduler

    class Recording(LocalScheduler):
        def __init__(self):
            super().__init__(SchedulerConfig(), tmp_path)
            self.specs, self.pinned = [], None

        def create_workers(self, spec, wait=True):
            self.waited = wait
            return RecordingScheduler.create_workers(self, spec)

        def wait_workers(self, role):
            self.waited = role

        def pin_trainer(self, cores=None, *, shared=None):
            self.pinned = (cores, shared)
            return 1

    machine = sorted(os.sched_getaffinity(0))

    def run(*overrides):
        cfg = load_config(None, [f"cluster.fileroot={tmp_path}", f"actor.path={tiny_path}",
                                 "train_dataset.path=unused.jsonl", *overrides])
        scheduler = Recording()
        scheduler.services = launch(cfg, run_paths(cfg), scheduler)
        return scheduler

    shared = run()
    [servers] = shared.specs
    assert servers.affinity == machine and shared.pinned[1] == machine
    path, slot = servers.env[cores.ENV].split(",")
    assert slot == "{index}" and os.path.exists(path)  # one slot per server, filled per worker
    # The inline trainer loads while the servers start; `ready` waits for them.
    assert shared.waited is False
    shared.services.ready()
    assert shared.waited == "inference"
    shared.stop_all()
    assert not os.path.exists(path)  # removed with the run
    for off in (["scheduler.share_cores=false"], ["rollout.backend=vllm"]):
        fixed = run(*off)
        assert fixed.specs[0].affinity is None and cores.ENV not in fixed.specs[0].env
        assert fixed.pinned[1] is None


def test_the_agent_services_spec_file_holds_no_admin_key(tmp_path, tiny_path):
    services, specs = _launch(tmp_path, tiny_path, "workflow.type=agent", "agent.fn=a:b",
                              "agent.admin_key=the-admin-key")
    [agent] = [s for s in specs if s.role == "agent"]
    assert agent.env["ASYNCRL_ADMIN_KEY"] == "the-admin-key"  # from its environment only
    file = _spec_file(agent.command)
    assert file.name == "agent.json" and "the-admin-key" not in file.read_text()
    cfg = load_config(None, [f"cluster.fileroot={tmp_path}", f"actor.path={tiny_path}",
                             "train_dataset.path=unused.jsonl", "scheduler.type=ray",
                             "cluster.n_nodes=2", "workflow.type=agent", "agent.fn=a:b",
                             "agent.admin_key=the-admin-key"])
    spec = read_spec(AgentServiceSpec, file)
    assert spec.agent.fn == "a:b" and spec.model_name == tiny_path and spec.backend == "local"
    assert spec == replace(build_agent_spec(cfg), agent=replace(cfg.agent, admin_key=None))
    assert services.placement.agent == "service"
