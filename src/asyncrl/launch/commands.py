"""The command lines that start the run's processes, the same under every scheduler.

`inference_spec` is the inference role (our local engine, vLLM or SGLang servers) as a
`WorkerSpec`; `server_command` is one server on a known host and port (`asyncrl serve`,
benchmarks).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from asyncrl.config.schema import LocalEngineConfig
from asyncrl.launch.base import WorkerSpec

BACKENDS = ("local", "vllm", "sglang")
# vLLM on CPU: every prefill in one step (its token budget then covers --max-model-len).
CPU_WHOLE_PREFILLS = ["--no-enable-chunked-prefill"]
# The ranks vLLM's --max-lora-rank accepts (vllm/config/lora.py MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class LoraServing:
    """What a vLLM or SGLang server must know at start to load the trainer's LoRA adapters
    at run time (actor.lora_rank, actor.target_modules); our own engine needs nothing."""

    rank: int
    target_modules: tuple[str, ...] = ("all-linear",)


def lora_server_args(backend: str, lora: LoraServing) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) that let a `backend` server load adapters of `lora`'s shape by
    its HTTP API while it runs."""
    if backend == "local":
        return [], {}  # our engine merges each published adapter folder into its base
    if backend == "vllm":
        fits = [r for r in VLLM_LORA_RANKS if r >= lora.rank]
        if not fits:
            raise ValueError(f"actor.lora_rank={lora.rank}: vLLM serves ranks up to "
                             f"{VLLM_LORA_RANKS[-1]}; choose a smaller rank")
        # /v1/load_lora_adapter and /v1/unload_lora_adapter exist only with this variable
        return (["--enable-lora", "--max-lora-rank", str(fits[0])],
                {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    # SGLang sizes its adapter buffers at start: the largest rank and every target module
    targets = ["all"] if list(lora.target_modules) == ["all-linear"] else list(lora.target_modules)
    return ["--enable-lora", "--max-lora-rank", str(lora.rank),
            "--lora-target-modules", *targets], {}


def server_command(backend: str, model_path: str, host: str, port: int, *,
                   dtype: str = "bfloat16", device: str = "cpu",
                   extra: Sequence[str] = ()) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) that start a `backend` server for `model_path` on host:port.

    `device` is "cpu", "cuda" (every visible GPU) or "cuda:<ids>" (e.g. "cuda:2" or
    "cuda:0,1", which sets CUDA_VISIBLE_DEVICES). `extra` is appended to argv as given.
    The environment is the current one plus what the backend needs.
    """
    argv = server_argv(backend, model_path, host, str(port), dtype=dtype, device=device)
    return argv + list(extra), dict(os.environ, **server_env(backend, host, device))


def server_argv(backend: str, model_path: str, host: str, port: str, *, dtype: str,
                device: str) -> list[str]:
    """The argv of one `backend` server (host and port may be placeholders)."""
    _check(backend, device)
    address = ["--host", host, "--port", port]
    if backend == "local":
        return [sys.executable, "-m", "asyncrl.inference.server.app", "--model", model_path,
                *address, "--dtype", dtype]
    if backend == "vllm":
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                model_path, *address, "--dtype", dtype,
                # log_softmax(logits / T) of the sampled token: what the trainer recomputes
                "--logprobs-mode", "processed_logprobs",
                # reload_weights that keeps tied embeddings tied (inference/client/vllm_worker.py)
                "--worker-extension-cls",
                "asyncrl.inference.client.vllm_worker.WeightSyncExtension",
                # /inference/v1/generate: token ids plus processed images (client/vllm.py)
                "--enable-scale-out"]
        if device == "cpu":
            # Eager mode starts fast; the KV cache is given in GB on CPU (VLLM_CPU_KVCACHE_SPACE).
            argv += ["--enforce-eager", "--gpu-memory-utilization", "0.3"]
            # A prefill split over steps rewinds its request's seeded generator, which a CPU
            # generator cannot do (the engine dies); whole prefills keep seeds usable.
            argv += CPU_WHOLE_PREFILLS
        return argv
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
            *address, "--dtype", dtype]
    return argv + (["--device", "cpu"] if device == "cpu" else [])


def server_env(backend: str, host: str, device: str) -> dict[str, str]:
    """What a `backend` server needs added to its environment."""
    _check(backend, device)
    env = {"PYTHONUNBUFFERED": "1",
           "HF_HUB_OFFLINE": "1"}  # a bad path must fail, never turn into a hub download
    if device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
    if backend == "vllm":
        env["VLLM_SERVER_DEV_MODE"] = "1"  # enables /collective_rpc (reload_weights)
        env["VLLM_HOST_IP"] = os.environ.get("VLLM_HOST_IP", host)  # its engine processes' address
        env["VLLM_NO_USAGE_STATS"] = "1"  # vLLM otherwise posts usage data to its stats server
        env["DO_NOT_TRACK"] = "1"
        if device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


# Each backend's flag for the share of its GPU's memory a server may take.
MEMORY_FRACTION_FLAGS = {"local": "--gpu-memory-fraction", "vllm": "--gpu-memory-utilization",
                         "sglang": "--mem-fraction-static"}
# Each backend's flag for the GPUs one server splits its model over (ours has none).
TENSOR_PARALLEL_FLAGS = {"vllm": "--tensor-parallel-size", "sglang": "--tp-size"}


def inference_spec(backend: str, model_path: str, engine_cfg: LocalEngineConfig, *,
                   n_servers: int, seed: int, device: str = "cpu", cpus: int = 1,
                   extra_args: Sequence[str] = (), cache_dir: str | None = None,
                   gpu_memory_fraction: float | None = None,
                   tensor_parallel_size: int = 1, expert_parallel_size: int = 1,
                   lora: LoraServing | None = None) -> WorkerSpec:
    """`n_servers` `backend` servers as the "inference" role; server i samples with seed + i.

    Each server runs `cpus` threads; `device` "cuda" also gives each one GPU (its scheduler
    picks which), "cuda:<ids>" gives all of them <ids>. `gpu_memory_fraction`: the share of
    its GPU's memory each server may take (`rollout.gpu_memory_fraction`; GPU servers only).
    `tensor_parallel_size`: the GPUs each server splits its model over (vLLM and SGLang on
    GPUs; the t of `rollout.backend: vllm:d<N>t<T>`); with "cuda" each server gets that many.
    `expert_parallel_size`: of those GPUs, how many split a Mixture-of-Experts model's
    experts (the e of `sglang:d<N>t<T>e<E>`): vLLM's --enable-expert-parallel (its expert
    group is all the server's tensor-parallel workers, so E must be T), SGLang's --ep-size E.
    `lora`: the servers load LoRA adapters of that shape (actor.use_lora).
    """
    if backend == "local":
        extra = ["--threads", "{cpus}", "--max-batch-size", str(engine_cfg.max_batch_size),
                 "--max-seq-len", str(engine_cfg.max_seq_len)]
        if not engine_cfg.recompute_kv_on_update:
            extra.append("--no-recompute-kv-on-update")
        seed_flag = "--seed"
    elif backend == "vllm":
        extra = ["--max-model-len", str(engine_cfg.max_seq_len),
                 "--max-num-seqs", str(engine_cfg.max_batch_size)]
        seed_flag = "--seed"
    else:
        extra = ["--context-length", str(engine_cfg.max_seq_len),
                 "--max-running-requests", str(engine_cfg.max_batch_size)]
        seed_flag = "--random-seed"
    if gpu_memory_fraction is not None:
        _check(backend, device)
        if device == "cpu":
            raise ValueError(f"gpu_memory_fraction={gpu_memory_fraction} is for GPU servers, "
                             "but device is 'cpu'")
        extra += [MEMORY_FRACTION_FLAGS[backend], str(gpu_memory_fraction)]
    if tensor_parallel_size != 1:
        _check_tensor_parallel(backend, device, tensor_parallel_size)
        extra += [TENSOR_PARALLEL_FLAGS[backend], str(tensor_parallel_size)]
    if expert_parallel_size != 1:
        extra += _expert_parallel_args(backend, tensor_parallel_size, expert_parallel_size)
    argv = server_argv(backend, model_path, "{host}", "{port}", dtype=engine_cfg.dtype,
                       device=device)
    env = server_env(backend, "{host}", device)
    if lora is not None:
        lora_argv, lora_env = lora_server_args(backend, lora)
        extra += lora_argv
        env.update(lora_env)
    if device == "cpu" and backend == "vllm":
        env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "{cores}")
    if backend == "vllm" and cache_dir:
        env["VLLM_CACHE_ROOT"] = os.environ.get("VLLM_CACHE_ROOT", cache_dir)
    return WorkerSpec(
        role="inference", count=n_servers, command=[*argv, *extra, *extra_args], env=env,
        cpus=cpus, gpus=tensor_parallel_size if device == "cuda" else 0,
        worker_args=[[seed_flag, str(seed + i)] for i in range(n_servers)])


def _check(backend: str, device: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {list(BACKENDS)}")
    if device != "cpu" and device != "cuda" and not device.startswith("cuda:"):
        raise ValueError(f"device {device!r} is not 'cpu', 'cuda' or 'cuda:<ids>'")


def _expert_parallel_args(backend: str, tensor: int, expert: int) -> list[str]:
    """vLLM's or SGLang's flags for `expert` of a server's `tensor` GPUs splitting the
    experts; ValueError for a size the backend cannot take."""
    if expert < 1 or tensor % expert:
        raise ValueError(f"expert_parallel_size={expert} must be >= 1 and divide "
                         f"tensor_parallel_size={tensor}: the experts are split among the "
                         "server's GPUs")
    if backend == "vllm":
        if expert != tensor:
            raise ValueError(f"vLLM splits the experts over all tensor_parallel_size={tensor} "
                             f"GPUs of a server (--enable-expert-parallel), not "
                             f"{expert}; use expert_parallel_size={tensor} or 1")
        return ["--enable-expert-parallel"]
    if backend == "sglang":
        return ["--ep-size", str(expert)]
    raise ValueError(f"expert parallel size {expert}: our {backend} engine runs a "
                     "Mixture-of-Experts model in one process; use the vllm or sglang "
                     "backend, or size 1")


def _check_tensor_parallel(backend: str, device: str, size: int) -> None:
    _check(backend, device)
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if backend not in TENSOR_PARALLEL_FLAGS:
        raise ValueError(f"tensor parallel size {size}: our {backend} engine runs each server "
                         "on one device; use the vllm or sglang backend, or size 1")
    if device == "cpu":
        raise ValueError(f"tensor parallel size {size} splits each {backend} server over "
                         "GPUs, but device is 'cpu'; use size 1 on the CPU")
