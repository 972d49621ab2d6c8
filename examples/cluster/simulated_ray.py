"""Any asyncrl RL config on a simulated Ray cluster of several nodes, on one machine.

    RAY_AUTH_MODE=disabled unshare --net sh -c 'ip link set lo up; exec \\
        python examples/cluster/simulated_ray.py --nodes 2 --cpus 1,2 \\
        --config src/asyncrl/recipes/quickstart.yaml allocation_mode=local:d1+fsdp:d1'

Starts `--nodes` Ray nodes on 127.0.0.1 (`ray.cluster_utils.Cluster`, node i with the i-th
of `--cpus` logical CPUs and `--gpus` GPUs), runs `train` with `scheduler.type=ray` joined
to it, prints the summary and where each process ran, and shuts the cluster down. Ray
binds every interface, so this refuses to run unless the loopback interface is the only
one (a private network namespace, as above). On a real cluster set `ray.address` instead.
"""

import argparse
import os
import socket
import sys

from asyncrl.cli import print_summary
from asyncrl.config import load_config
from asyncrl.controller.rl import train


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--cpus", default="2", help="logical CPUs per node: one value, or one "
                        "per node comma-separated")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs per node")
    parser.add_argument("overrides", nargs="*", help="key=value")
    args = parser.parse_args()
    if [name for _, name in socket.if_nameindex()] != ["lo"]:
        sys.exit("refusing to start Ray: interfaces other than lo exist and Ray binds every "
                 "interface; run inside `unshare --net` (see the docstring)")
    cpus = [int(c) for c in args.cpus.split(",")]
    cpus = cpus * args.nodes if len(cpus) == 1 else cpus
    if len(cpus) != args.nodes:
        sys.exit(f"--cpus gives {len(cpus)} values for {args.nodes} nodes")

    import ray
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    node = {"node_ip_address": "127.0.0.1", "num_gpus": args.gpus}
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        node, num_cpus=cpus[0], include_dashboard=False))
    for n in cpus[1:]:
        cluster.add_node(**node, num_cpus=n)
    try:
        ray.init(address=cluster.address, _node_ip_address="127.0.0.1")
        cfg = load_config(args.config, [
            "scheduler.type=ray", f"cluster.n_nodes={args.nodes}",
            f"cluster.n_gpus_per_node={args.gpus}", f"ray.address={cluster.address}",
            *args.overrides])
        summary = train(cfg)
        print_summary(summary)
        nodes = sorted({s["node_id"] for s in summary["services"]})
        for s in summary["services"]:
            print(f"{s['role']} {s['index']}: {s['address']} on node {nodes.index(s['node_id'])}")
    finally:
        ray.shutdown()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
