"""What an RL run asks its scheduler for: the inference and trainer roles, keys, placement."""

from pathlib import Path

from asyncrl.config import load_config
from asyncrl.controller.launch import launch
from asyncrl.launch.base import Worker
from asyncrl.launch.local import rank_cores
from asyncrl.observe.paths import RunPaths
from asyncrl.trainer.service import TrainingClient


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
    return launch(cfg, RunPaths.from_config(cfg), scheduler), scheduler.specs


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
    assert str(Path(tmp_path) / "asyncrl" / "trial0" / "config.yaml") in ranks.command
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
        scheduler.services = launch(cfg, RunPaths.from_config(cfg), scheduler)
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
