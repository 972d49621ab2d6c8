"""`asyncrl sft | dpo | rm` with allocation_mode `fsdp:d<N>`: start the N ranks, wait for them.

Run from a shell (no RANK / WORLD_SIZE in the environment) with N > 1, the command becomes
a launcher, like torchrun: it writes the resolved config into the run directory and asks
the scheduler (local: processes on this machine) for N `trainer` workers that each run the
same subcommand on that config as one rank of the process group. Each rank computes what it
would under torchrun (the whole batch is planned into micro-batches across the ranks,
gradients are summed), and rank 0 writes the run's record.

The scheduler says which ranks still run, not how they ended, so each rank leaves a report
in <run>/ranks/<rank>.json when it finishes or fails; a rank that exits without a report
was killed. The first rank to fail (or to vanish) stops the run with its log's tail; the
others are stopped with the scheduler. With one rank, or under torchrun, the trainer runs
in this process as before.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from asyncrl.config import load_config, to_yaml
from asyncrl.config.offline import TRAINER_SCHEMAS, OfflineConfig
from asyncrl.config.schema import SchedulerConfig
from asyncrl.launch import make_scheduler
from asyncrl.launch.base import Scheduler, SchedulerError, WorkerSpec, log_tail
from asyncrl.launch.local import rank_cores
from asyncrl.observe.paths import RunPaths, setup_logging

logger = logging.getLogger(__name__)
ROLE = "trainer"
REPORTS_ENV = "ASYNCRL_RANK_REPORTS"  # the folder where a launched rank writes its report


def main(command: str, argv: list[str]) -> int:
    """`python -m asyncrl.offline.<command> --config FILE key=value ...`: as `asyncrl <command>`."""
    p = argparse.ArgumentParser(prog=f"python -m asyncrl.offline.{command}")
    p.add_argument("--config", default=None, help="YAML config file (else defaults)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. model.path=x")
    args = p.parse_args(argv)
    return run_command(command, args.config, args.overrides)


def run_command(command: str, config: str | None, overrides: list[str]) -> int:
    """Load `config` with `overrides` as `command`'s schema, train, print the summary."""
    cfg = load_config(config, overrides, schema=TRAINER_SCHEMAS[command])
    print_offline_summary(run(command, cfg))
    return 0


def print_offline_summary(summary: dict) -> None:
    """Held-out figures before -> after training, and where the run and model are."""
    before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}
    print("\n== asyncrl run finished ==")
    print(f"run directory : {summary['run_dir']}")
    for key in sorted(set(before) | set(after)):
        b, a = before.get(key), after.get(key)
        text = " -> ".join(f"{v:.4f}" for v in (b, a) if v is not None)
        print(f"held-out {key:16s}: {text}" + (f"  ({a - b:+.4f})" if None not in (a, b) else ""))
    for key in ("stats", "model_dir"):
        if key in summary:
            print(f"{key:14s}: {summary[key]}")


def run(command: str, cfg: OfflineConfig) -> dict[str, Any]:
    """`asyncrl <command>` (sft | dpo | rm): train here, or start allocation_mode's ranks."""
    if is_launcher(cfg):
        return launch(command, cfg)
    trainer = importlib.import_module(f"asyncrl.offline.{command}")
    reports = os.environ.get(REPORTS_ENV)
    if reports is None:
        return trainer.train(cfg)
    try:
        summary = trainer.train(cfg)
    except BaseException as err:
        write_report(Path(reports), ok=False, error=f"{type(err).__name__}: {err}")
        raise
    write_report(Path(reports), ok=True, summary=summary)
    return summary


def is_launcher(cfg: OfflineConfig) -> bool:
    """More than one rank asked for, and this process is not one (torchrun or ours started it)."""
    return cfg.trainer_world_size > 1 and not {"RANK", "WORLD_SIZE"} & set(os.environ)


def rank_spec(command: str, cfg: OfflineConfig, config_path: Path, reports: Path) -> WorkerSpec:
    """The N ranks: `asyncrl <command>` on the run's resolved config, torchrun's variables set.

    On GPUs every rank sees the node's GPUs and takes GPU LOCAL_RANK, as under torchrun. The
    cores are split evenly between the ranks unless scheduler.trainer_threads gives each rank
    its own number (the scheduler then hands them out in turn).
    """
    world, threads = cfg.trainer_world_size, cfg.scheduler.trainer_threads
    cores = None if threads else rank_cores(sorted(os.sched_getaffinity(0)), world)
    gpus = cfg.cluster.n_gpus_per_node > 0
    return WorkerSpec(
        role=ROLE, count=world,
        command=[sys.executable, "-m", "asyncrl.cli", command, "--config", str(config_path)],
        env={REPORTS_ENV: str(reports), "PYTHONUNBUFFERED": "1"},
        cpus=threads or len(cores[0]), gpus=1 if gpus else 0,
        gpu_ids=[[] for _ in range(world)] if gpus else None,  # [] : CUDA_VISIBLE_DEVICES kept
        cores=cores, torch_distributed=True, health_path=None)


def launch(command: str, cfg: OfflineConfig) -> dict[str, Any]:
    """Start the ranks under the scheduler, wait for all; rank 0's summary, or an error."""
    paths = RunPaths.from_names(cfg.cluster.fileroot, cfg.experiment_name, cfg.trial_name)
    setup_logging(paths.root)
    config_path = paths.root / "config.yaml"
    config_path.write_text(to_yaml(cfg))
    reports = paths.root / "ranks"
    shutil.rmtree(reports, ignore_errors=True)  # an earlier run's, in this trial's folder
    reports.mkdir()
    spec = rank_spec(command, cfg, config_path, reports)
    scheduler_cfg = SchedulerConfig(type=cfg.scheduler.type,
                                    trainer_threads=cfg.scheduler.trainer_threads)
    with make_scheduler(scheduler_cfg, cfg.cluster, paths.root) as scheduler:
        workers = scheduler.create_workers(spec)
        logger.info("asyncrl %s: %d ranks started (%s); their logs: %s", command, len(workers),
                    cfg.allocation_mode, paths.logs / f"{ROLE}-<rank>.log")
        return wait_for_ranks(scheduler, reports, len(workers))["summary"]


def wait_for_ranks(scheduler: Scheduler, reports: Path, world: int,
                   interval: float = 0.5) -> dict[str, Any]:
    """Poll until every rank has exited with a report of success; rank 0's report.

    Raises SchedulerError, naming the rank and showing its log's tail, for the first rank
    that reports a failure or exits without a report (the others fail after it, in a
    collective that lost its peer, or wait there until they are stopped).
    """
    workers = scheduler.get_workers(ROLE)
    while True:
        alive = scheduler.check_health(ROLE)
        found = {r: read_report(reports, r) for r in range(world)}
        failed = sorted((rep["time"], r) for r, rep in found.items() if rep and not rep["ok"])
        vanished = [r for r in range(world) if not alive[r] and found[r] is None]
        if failed or vanished:
            rank = failed[0][1] if failed else vanished[0]
            why = (f"failed ({found[rank]['error']})" if failed
                   else "exited without a report (killed, or it crashed)")
            log = workers[rank].log_path
            raise SchedulerError(f"{ROLE} rank {rank} of {world} {why}; the end of {log}:\n"
                                 f"{log_tail(log)}")
        if not any(alive):
            return found[0]
        time.sleep(interval)


def write_report(reports: Path, *, ok: bool, summary: dict[str, Any] | None = None,
                 error: str | None = None) -> None:
    """This rank's <reports>/<RANK>.json, written whole (the launcher may read it any time)."""
    rank = int(os.environ.get("RANK", "0"))
    path = reports / f"{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"rank": rank, "ok": ok, "time": time.time(), "error": error,
                               "summary": summary}, default=str))
    os.replace(tmp, path)


def read_report(reports: Path, rank: int) -> dict[str, Any] | None:
    try:
        return json.loads((reports / f"{rank}.json").read_text())
    except FileNotFoundError:
        return None
