"""`auto` resolved once, into inline or service per role.

The expected places below are worked out by hand from the rules the config documents:
trainer `auto` is inline only for one rank under the local scheduler; router and agent
`auto` are services off the local scheduler; weight_update `auto` is a service off the
local scheduler when the trainer ranks are a service; no agent workflow, no agent service.
"""

import pytest

from asyncrl.config import load_config
from asyncrl.config.schema import SchedulerConfig
from asyncrl.controller.placement import Placement, resolve_placement
from asyncrl.controller.specs import build_placement

I, S = "inline", "service"


@pytest.mark.parametrize("scheduler, world, agent, want", [
    # (trainer, router, agent, weight_update)
    ({"type": "local"}, 1, True, (I, I, I, I)),
    ({"type": "local"}, 2, True, (S, I, I, I)),  # local: the weight update stays inline
    ({"type": "ray"}, 1, True, (S, S, S, S)),
    ({"type": "slurm"}, 1, True, (S, S, S, S)),
    ({"type": "slurm"}, 4, True, (S, S, S, S)),
    ({"type": "ray"}, 1, False, (S, S, I, S)),  # no agent workflow: no agent service
    ({"type": "local", "trainer": "service"}, 1, True, (S, I, I, I)),
    ({"type": "local", "trainer": "service", "weight_update": "service"}, 1, True,
     (S, I, I, S)),
    ({"type": "local", "router": "service", "agent": "service"}, 1, True, (I, S, S, I)),
    ({"type": "local", "router": "service", "agent": "service"}, 1, False, (I, S, I, I)),
    ({"type": "ray", "router": "inline", "agent": "inline", "weight_update": "inline"}, 2,
     True, (S, I, I, I)),
    ({"type": "slurm", "trainer": "service", "weight_update": "auto"}, 1, True,
     (S, S, S, S)),
])
def test_auto_resolves_per_scheduler_type(scheduler, world, agent, want):
    place = resolve_placement(SchedulerConfig(**scheduler), trainer_world_size=world,
                              agent_workflow=agent)
    assert (place.trainer, place.router, place.agent, place.weight_update) == want


def test_a_weight_update_service_without_trainer_services_is_refused():
    with pytest.raises(ValueError, match="scheduler.weight_update=service needs the trainer "
                                         r"ranks as a service \(scheduler.trainer=service"):
        resolve_placement(SchedulerConfig(weight_update="service"), trainer_world_size=1,
                          agent_workflow=False)


def test_the_runs_placement_reads_world_size_and_workflow_from_the_config():
    cfg = load_config(None, ["train_dataset.path=x", "allocation_mode=local:d1+fsdp:d2"])
    assert build_placement(cfg) == Placement(trainer=S, router=I, agent=I, weight_update=I)
    cfg = load_config(None, ["train_dataset.path=x", "scheduler.type=ray",
                             "workflow.type=agent", "agent.fn=a:b"])
    assert build_placement(cfg) == Placement(trainer=S, router=S, agent=S, weight_update=S)
