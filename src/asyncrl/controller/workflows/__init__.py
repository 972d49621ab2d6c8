"""Workflows: from a dataset item to a group of scored trajectories."""

from asyncrl.controller.workflows.rlvr import (
    RLVRWorkflow,
    gather_or_cancel,
    sampling_params,
)

__all__ = ["RLVRWorkflow", "gather_or_cancel", "sampling_params"]
