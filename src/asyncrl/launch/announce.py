"""Run one worker where a batch system put it, and say where it listens.

    python -m asyncrl.launch.announce --dir DIR [--spec SPEC.json] [--index I] [--host H] \
        [-- command ...]

Picks a free port on this node, fills the placeholders ("{host}", "{port}", ...) of the
command (the spec's, else the one after `--`), writes DIR/<index>.json (host, port, pid,
node) and then becomes the command (exec: same pid). The Slurm scheduler runs it under
srun and waits for those files; the index is SLURM_PROCID unless --index says otherwise.
With a spec asking for torch_distributed it sets RANK, WORLD_SIZE, LOCAL_RANK and
LOCAL_WORLD_SIZE from Slurm's variables (MASTER_ADDR/PORT come from the batch script).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
from pathlib import Path

from asyncrl.launch.base import WorkerSpec


def node_address() -> str:
    """This node's address as others reach it: a non-loopback IPv4 of its name, else the name."""
    name = socket.gethostname()
    try:
        found = {info[4][0] for info in socket.getaddrinfo(name, None, socket.AF_INET)}
    except socket.gaierror:
        return name
    public = sorted(a for a in found if not a.startswith("127."))
    return public[0] if public else name


def tasks_on_node(tasks_per_node: str, node: int) -> int:
    """Slurm's SLURM_TASKS_PER_NODE ("2(x3),1") for node number `node`."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            raise ValueError(f"cannot read SLURM_TASKS_PER_NODE={tasks_per_node!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node]


def rank_env(index: int, world_size: int, env: dict[str, str]) -> dict[str, str]:
    """torchrun's rank variables from Slurm's (MASTER_ADDR/PORT are left as exported)."""
    local_world = tasks_on_node(env.get("SLURM_TASKS_PER_NODE", str(world_size)),
                                int(env.get("SLURM_NODEID", "0")))
    return {"RANK": str(index), "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": env.get("SLURM_LOCALID", "0"), "LOCAL_WORLD_SIZE": str(local_world)}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m asyncrl.launch.announce")
    parser.add_argument("--dir", required=True, help="write <dir>/<index>.json")
    parser.add_argument("--spec", help="a WorkerSpec as JSON (command, env, rank variables)")
    parser.add_argument("--index", type=int, help="default: $SLURM_PROCID")
    parser.add_argument("--host", help="address to bind and announce (default: this node's)")
    args = parser.parse_args(own)
    if args.spec:
        spec = WorkerSpec(**json.loads(Path(args.spec).read_text()))
    elif command:
        spec = WorkerSpec("worker", 1, command, cpus=0, health_path=None)
    else:
        parser.error("give --spec or a command after --")
    index = args.index if args.index is not None else int(os.environ.get("SLURM_PROCID", "0"))
    host = args.host or node_address()
    port = spec.pick_port(host)
    cpus = int(os.environ.get("SLURM_CPUS_PER_TASK", spec.cpus))
    values = {"host": host, "port": str(port), "index": str(index), "cpus": str(cpus),
              "cores": ",".join(map(str, sorted(os.sched_getaffinity(0))))}
    env = dict(os.environ)
    if cpus:
        env["OMP_NUM_THREADS"] = str(cpus)
    if spec.torch_distributed:
        env.update(rank_env(index, spec.count, env))
    env.update(spec.environment(values))
    argv_out = spec.argv(index, values) if args.spec else spec.argv(0, values)
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    record = {"index": index, "host": host, "port": port, "pid": os.getpid(),
              "hostname": socket.gethostname(),
              "node_id": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
              "job_id": os.environ.get("SLURM_JOB_ID", "")}
    tmp = out / f".{index}.json.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, out / f"{index}.json")
    sys.stdout.flush()
    os.execvpe(argv_out[0], argv_out, env)


if __name__ == "__main__":
    main()
