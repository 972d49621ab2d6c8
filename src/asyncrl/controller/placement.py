"""Where each part of an RL run runs: in the controller's process, or as a service process.

`scheduler.trainer`, `.router`, `.agent` and `.weight_update` may say `auto`; this is the one
place that turns them into `inline` or `service`. Launch and the loop read the `Placement`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from asyncrl.config.schema import SchedulerConfig

Where = Literal["inline", "service"]


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Each role's place, with no `auto` left."""

    trainer: Where  # the trainer ranks: in the controller (one rank) or training services
    router: Where  # the controller's own client routes, or a router process
    # The agent proxy: on the controller's rollout loop, or its own process. Always
    # `inline` when the workflow is not an agent's (no proxy runs at all).
    agent: Where
    weight_update: Where  # the controller carries the versions, or a weight-update process


def resolve_placement(scheduler: SchedulerConfig, *, trainer_world_size: int,
                      agent_workflow: bool) -> Placement:
    """`scheduler`'s choices resolved: `auto` is a service off the local scheduler and
    inline on it, but for the trainer (inline only for one local rank) and the weight
    update (a service off the local scheduler when the trainer ranks are a service)."""
    local = scheduler.type == "local"

    def resolve(choice: str, auto: bool) -> Where:
        return "service" if (auto if choice == "auto" else choice == "service") else "inline"

    trainer = resolve(scheduler.trainer, not (local and trainer_world_size == 1))
    if scheduler.weight_update == "service" and trainer != "service":
        raise ValueError("scheduler.weight_update=service needs the trainer ranks as a service "
                         "(scheduler.trainer=service, or several fsdp ranks); set "
                         "scheduler.weight_update=inline or auto")
    agent = resolve(scheduler.agent, not local) if agent_workflow else "inline"
    return Placement(trainer=trainer, router=resolve(scheduler.router, not local), agent=agent,
                     weight_update=resolve(scheduler.weight_update,
                                           not local and trainer == "service"))
