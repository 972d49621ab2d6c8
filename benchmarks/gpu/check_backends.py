"""On a GPU machine: start a vLLM and/or SGLang server and check our clients against it.

    python benchmarks/gpu/check_backends.py --model /path/to/hf/folder --backend vllm sglang

For each backend it starts one server (GPU --gpu) through the scheduler, then runs
generate, pause/resume, reload from disk, version, an update in the middle of a long
generation and a bad checkpoint through the InferenceEngine client, and prints one
PASS/FAIL line per check with its time. Exit status 1 if any check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from asyncrl.api import GenerationRequest, SamplingParams
from asyncrl.config import LocalEngineConfig
from asyncrl.config.schema import SchedulerConfig
from asyncrl.inference.client.backends import client_class
from asyncrl.inference.client.base import WeightUpdateError
from asyncrl.launch import LocalScheduler

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def perturbed_copy(model: str, out: Path, scale: float) -> str:
    """`model` with every weight multiplied by (1 + scale * noise): other weights, same shapes."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(1 + scale * torch.randn_like(p))
    m.save_pretrained(out)
    AutoTokenizer.from_pretrained(model).save_pretrained(out)
    return str(out)


def greedy(n: int) -> GenerationRequest:
    return GenerationRequest(input_ids=PROMPT, sampling=SamplingParams(
        max_new_tokens=n, temperature=0.0, ignore_eos=True))


async def run_checks(client, model: str, other: str, check: Callable) -> None:
    """The checks, in order; `check(name, coro)` times one and records PASS/FAIL."""
    async def generate():
        rs = await asyncio.gather(*(client.agenerate(GenerationRequest(
            input_ids=PROMPT, sampling=SamplingParams(max_new_tokens=32))) for _ in range(8)))
        assert all(len(r.output_ids) == len(r.output_logprobs) > 0 for r in rs)
        assert all(set(r.output_versions) == {0} for r in rs)
        return f"{sum(len(r.output_ids) for r in rs)} tokens"
    await check("generate (8 x 32 tokens)", generate())
    before = await client.agenerate(greedy(16))

    async def pause_resume():
        await client.pause()
        gen = asyncio.ensure_future(client.agenerate(greedy(8)))
        await asyncio.sleep(1.0)
        assert not gen.done(), "a request finished while paused"
        await client.resume()
        assert len((await gen).output_ids) == 8
    await check("pause keeps a request, resume finishes it", pause_resume())

    async def reload():
        t0 = time.monotonic()
        await client.update_weights_from_disk(other, 1)
        took = time.monotonic() - t0
        assert await client.get_version() == 1
        after = await client.agenerate(greedy(16))
        assert after.output_ids != before.output_ids, "greedy output unchanged by the reload"
        assert set(after.output_versions) == {1}
        return f"reload {took:.2f}s"
    await check("reload from disk changes version and output", reload())

    async def interrupt():
        gen = asyncio.ensure_future(client.agenerate(GenerationRequest(
            input_ids=PROMPT, sampling=SamplingParams(max_new_tokens=2000, ignore_eos=True))))
        await asyncio.sleep(1.0)
        await client.update_weights_from_disk(model, 2)
        r = await gen
        assert set(r.output_versions) == {1, 2}, f"versions {sorted(set(r.output_versions))}"
        assert r.output_versions == sorted(r.output_versions) and len(r.output_ids) == 2000
        return f"{r.output_versions.count(1)} tokens at v1, {r.output_versions.count(2)} at v2"
    await check("update mid-generation gives two versions", interrupt())

    async def bad_checkpoint():
        try:
            await client.update_weights_from_disk("/nonexistent/weights", 3)
        except WeightUpdateError as e:
            assert await client.get_version() == 2
            return str(e)[:60]
        raise AssertionError("no WeightUpdateError")
    await check("bad checkpoint raises WeightUpdateError", bad_checkpoint())


def check_backend(backend: str, model: str, other: str, args, results: list) -> None:
    """Start one `backend` server, run the checks, stop it."""
    async def check(name: str, coro) -> None:
        t0 = time.monotonic()
        try:
            detail = await coro
            results.append((backend, name, True, time.monotonic() - t0, detail or ""))
        except Exception as e:  # report every check, then fail at the end
            results.append((backend, name, False, time.monotonic() - t0, f"{type(e).__name__}: {e}"))
        print("%-6s %-4s %-45s %6.2fs %s" % (backend, "PASS" if results[-1][2] else "FAIL",
                                           name, results[-1][3], results[-1][4]), flush=True)

    log_dir = Path(tempfile.mkdtemp(prefix=f"check-{backend}-"))
    sched = SchedulerConfig(startup_timeout=args.startup_timeout)
    engine = LocalEngineConfig(dtype=args.dtype, max_batch_size=32, max_seq_len=4096)
    with LocalScheduler(sched, log_dir) as scheduler:
        t0 = time.monotonic()
        try:
            addresses = scheduler.launch_inference_servers(
                model, engine, n_servers=1, seed=0, backend=backend, device=f"cuda:{args.gpu}")
        except Exception as e:
            results.append((backend, "start", False, time.monotonic() - t0, str(e)[-300:]))
            print(f"{backend:6s} FAIL start: {e}", flush=True)
            return
        print(f"{backend:6s} PASS start {time.monotonic() - t0:.1f}s (logs {log_dir})", flush=True)
        client = client_class(backend)(addresses, request_timeout=600,
                                       update_weights_timeout=args.update_timeout)
        try:
            asyncio.run(run_checks(client, model, other, check))
        finally:
            asyncio.run(client.close())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a local HF folder (small: e.g. Qwen2.5-0.5B)")
    p.add_argument("--backend", nargs="+", choices=["vllm", "sglang"], default=["vllm"])
    p.add_argument("--gpu", default="0", help="GPU id(s) for the server, e.g. 0 or 0,1")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--update-timeout", type=float, default=120.0)
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="check-weights-"))
    try:
        other = perturbed_copy(args.model, tmp / "other", scale=0.05)
        results: list = []
        for backend in args.backend:
            check_backend(backend, str(Path(args.model).resolve()), other, args, results)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    failed = [r for r in results if not r[2]]
    print(f"\n{len(results) - len(failed)}/{len(results)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
