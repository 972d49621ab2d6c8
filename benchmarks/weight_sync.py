"""Weight sync, disk vs broadcast: seconds from publish() to new weights served.

    python benchmarks/weight_sync.py                       # SmolLM2-135M-Instruct, bf16
    python benchmarks/weight_sync.py --reps 9 --bucket-mb 256 32

One local inference server (a subprocess) and an FSDP train engine in this process (one
rank, as the quickstart runs it). Each repetition publishes the trainer's weights as a new
version and ends when every server serves them (the publisher's whole call: disk = save
the safetensors folder, then pause, reload, set the version, resume; broadcast = gather,
then pause, receive the buckets, set the version, resume). The modes alternate so that
noise from other work on the machine falls on both. The first publish of each mode is
reported apart (broadcast: the process group is made; both: the server's spare weight
buffers are first allocated). Disk runs beside each broadcast bucket size; its figures
pool those runs. At the end the server's weights digest is checked against
the trainer's weights.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from asyncrl.config.engine import TrainEngineSpec
from asyncrl.inference.client import LocalServerClient
from asyncrl.inference.server.model import Transformer, Weights
from asyncrl.models.hub import resolve_model_path
from asyncrl.trainer import FSDPTrainEngine
from asyncrl.weights import BroadcastPublisher, WeightPublisher


def start_server(model: str, threads: int, log: Path) -> tuple[subprocess.Popen, str]:
    """A local inference server on a free port; its address once it listens."""
    with open(log, "w") as err:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen([sys.executable, "-m", "asyncrl.inference.server.app", "--model",
                                 model, "--port", "0", "--threads", str(threads), "--dtype",
                                 "bfloat16"], stdout=subprocess.PIPE, stderr=err, text=True)
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        if "listening on " in line:
            return proc, line.rsplit("listening on ", 1)[1].strip()
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"server did not start; see {log}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--reps", type=int, default=7, help="timed publishes per mode (after one warm-up)")
    p.add_argument("--bucket-mb", type=int, nargs="+", default=[256])
    p.add_argument("--threads", type=int, default=1, help="torch threads of server and trainer")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    work = Path(tempfile.mkdtemp(prefix="weight_sync_"))
    proc, address = start_server(path, args.threads, work / "server.log")
    client = LocalServerClient([address], update_weights_timeout=120)
    actor = FSDPTrainEngine(TrainEngineSpec(path=path, dtype="bfloat16"), total_steps=1)
    actor.initialize()
    disk = WeightPublisher(work / "weights", client, dtype="bfloat16")
    broadcasts = {f"broadcast {mb} MiB": BroadcastPublisher(client, dtype="bfloat16",
                                                            bucket_mb=mb, timeout=120)
                  for mb in args.bucket_mb}
    names = ["disk", *broadcasts]
    times: dict[str, list[float]] = {name: [] for name in names}
    first: dict[str, float] = {}
    parts: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    version = 0
    try:
        # One phase per bucket size (a server is in one group at a time), disk alternating.
        for name, pub in broadcasts.items():
            for rep in range(args.reps + 1):
                for mode, publisher in (("disk", disk), (name, pub)):
                    version += 1
                    t0 = time.perf_counter()
                    stats = publisher.publish(actor, version)
                    elapsed = time.perf_counter() - t0
                    if rep == 0:
                        first.setdefault(mode, elapsed)
                    else:
                        times[mode].append(elapsed)
                        parts[mode].append(stats)
            pub.close()
        served = json.load(urllib.request.urlopen(address + "/weights_checksum"))
        model = Transformer.from_pretrained(path, dtype=torch.bfloat16, max_seq_len=16)
        expected = Weights(model.cfg, actor.hf_state_dict(torch.bfloat16), torch.bfloat16,
                           pack=model.pack_mode()).digest()
    finally:
        asyncio.run(client.close())
        actor.destroy()
        proc.terminate()
        proc.wait()

    disk = statistics.median(times["disk"])
    print(f"\n{args.model}, bf16, {args.reps} publishes per broadcast mode (+1 warm-up), "
          f"{args.threads} thread(s) each side, one local server")
    print(f"{'mode':<22}{'first s':>9}{'median s':>10}{'min s':>8}{'vs disk':>9}   median parts")
    for name, ts in times.items():
        med = statistics.median(ts)
        keys = sorted({k for s in parts[name] for k in s if k.startswith("perf/")})
        detail = ", ".join(f"{k.removeprefix('perf/weights_')} "
                           f"{statistics.median(s.get(k, 0.0) for s in parts[name]):.3f}"
                           for k in keys)
        print(f"{name:<22}{first[name]:>9.3f}{med:>10.3f}{min(ts):>8.3f}{disk / med:>8.2f}x   "
              f"{detail}")
    ok = served["version"] == version and served["sha256"] == expected
    print(f"server holds version {served['version']} (last published {version}); "
          f"digest {'equals' if ok else 'DIFFERS FROM'} the trainer's weights")


if __name__ == "__main__":
    main()
