"""The steps of `check.py`, each run in a child process of its own (a hung CUDA call can only
be ended by ending its process):

    python benchmarks/gpu/check_steps.py WORKER --spec JSON --result FILE

Workers: `build` (random bf16 models of the shapes below, saved as HF folders), `calibrate`
(the device's bf16 matmul peak and copy bandwidth, measured), `shape` (one shape's training
steps, decode throughput and weight publishing), `lora` (LoRA steps, an adapter-only publish
and the engine's log-probs under it), `moe` (a Qwen3-MoE training step with routing replay
on the engine's recorded routes) and `grpo` (`grpo_one_gpu.run`). Each writes
its measurements to FILE as JSON after every part, so a part that crashes or hangs leaves
the earlier parts' numbers; derived figures (MFU, the bandwidth limit) are left to
`check.py`, which has the calibration.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: train_step's FLOP count

# Published configs (their config.json values). All three tie the output projection to the
# input embedding; Qwen3 has per-head q/k RMSNorm.
SHAPES = {
    "smollm2-135m": dict(arch="llama", hidden_size=576, intermediate_size=1536, num_layers=30,
                         num_heads=9, num_kv_heads=3, head_dim=64, vocab_size=49152,
                         rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192),
    "qwen3-0.6b": dict(arch="qwen3", hidden_size=1024, intermediate_size=3072, num_layers=28,
                       num_heads=16, num_kv_heads=8, head_dim=128, vocab_size=151936,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960),
    "qwen3-1.7b": dict(arch="qwen3", hidden_size=2048, intermediate_size=6144, num_layers=28,
                       num_heads=16, num_kv_heads=8, head_dim=128, vocab_size=151936,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960),
}
# `--device cpu`: the same architectures at a width the CPU runs in seconds.
TINY = dict(hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=1, head_dim=32)
TINY_LAYERS = {"smollm2-135m": 2, "qwen3-0.6b": 3, "qwen3-1.7b": 4}

# Per mode: the training batch (groups x samples of a shared prompt and answers of random
# lengths), micro-batch tokens, warm-up and timed steps; the decode lengths; publishes.
SIZES = {
    "full": dict(groups=8, samples=8, prompt=256, answer=(128, 384), max_tokens_per_mb=8192,
                 warm_up=1, steps=3, new_tokens=128, decode_batches=(1, 64), decode_runs=1,
                 publishes=1, gap_rows=8, gap_tokens=32),
    "tiny": dict(groups=2, samples=4, prompt=16, answer=(8, 24), max_tokens_per_mb=1024,
                 warm_up=1, steps=2, new_tokens=16, decode_batches=(1, 64), decode_runs=3,
                 publishes=2, gap_rows=4, gap_tokens=8),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---- build ------------------------------------------------------------------------------

def load_tokenizer(assets: str | None):
    """SmolLM2's tokenizer from the assets folder, else the tiny byte-level one (no files)."""
    from transformers import AutoTokenizer

    from asyncrl.models.tiny import make_tiny_tokenizer

    folder = Path(assets or "", "tokenizer")
    if assets and (folder / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(folder)), "smollm2"
    return make_tiny_tokenizer(), "byte-level (no SmolLM2 tokenizer in the assets)"


def hf_config(shape: dict, tokenizer):
    """The transformers config of a shape, with the tokenizer's special token ids."""
    import transformers

    cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[shape["arch"]]
    return cls(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
               intermediate_size=shape["intermediate_size"],
               num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_heads"],
               num_key_value_heads=shape["num_kv_heads"], head_dim=shape["head_dim"],
               max_position_embeddings=shape["max_position_embeddings"],
               rms_norm_eps=shape["rms_norm_eps"], tie_word_embeddings=True,
               rope_parameters={"rope_type": "default", "rope_theta": shape["rope_theta"]},
               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)


def shape_of(name: str, tiny: bool, vocab: int) -> dict:
    """A published shape, or its tiny version (the tokenizer's vocabulary, rounded up)."""
    shape = dict(SHAPES[name])
    if tiny:
        shape |= TINY | {"num_layers": TINY_LAYERS[name], "vocab_size": (vocab + 63) // 64 * 64}
    return shape


def build(spec: dict, result: dict, save: Callable[[], None]) -> None:
    """Random bf16 models of every shape, initialised on the device, saved as HF folders."""
    from transformers import AutoModelForCausalLM

    tokenizer, kind = load_tokenizer(spec["assets"])
    result["tokenizer"] = kind
    for name in SHAPES:
        with part(result, name, save) as out:
            shape = shape_of(name, spec["tiny"], len(tokenizer))
            out["shape"] = shape
            torch.manual_seed(0)
            with torch.device(spec["device"]):  # initialised where it runs: no fp32 copy
                model = AutoModelForCausalLM.from_config(hf_config(shape, tokenizer),
                                                         dtype=torch.bfloat16)
            out["params"] = sum(p.numel() for p in model.parameters())
            path = Path(spec["models"], name)
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
            del model
            if spec["device"].startswith("cuda"):
                torch.cuda.empty_cache()
            out["path"] = str(path)  # only once the folder is whole
            log(f"built {name}: {out['params'] / 1e6:.1f}M parameters")


# ---- calibrate --------------------------------------------------------------------------

def timed(device: str, fn: Callable[[], None], reps: int, trials: int) -> float:
    """Best over `trials` of the mean seconds of `reps` calls (CUDA events on a GPU)."""
    fn()
    sync(device)
    best = float("inf")
    for _ in range(trials):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            seconds = time.perf_counter() - t0
        best = min(best, seconds / reps)
    return best


def calibrate(spec: dict, result: dict, save: Callable[[], None]) -> None:
    """The bf16 matmul peak (best square product) and the device-copy bandwidth."""
    device = spec["device"]
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        result["device_name"] = props.name
        result["capability"] = f"{props.major}.{props.minor}"
        result["memory_bytes"] = props.total_memory
        result["torch_cuda"] = torch.version.cuda
        sizes, reps, copy_bytes = (4096, 8192, 16384), 10, 2 << 30
    else:
        result["device_name"] = f"CPU, {torch.get_num_threads()} threads"
        sizes, reps, copy_bytes = (256, 512, 1024), 3, 256 << 20
    peaks = {}
    for n in sizes:
        a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
        b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
        c = torch.empty(n, n, dtype=torch.bfloat16, device=device)
        peaks[n] = 2 * n**3 / timed(device, lambda: torch.matmul(a, b, out=c), reps, 5)
        del a, b, c
    result["matmul_flops_by_size"] = peaks
    result["peak_flops"] = max(peaks.values())
    log(f"bf16 matmul peak {result['peak_flops'] / 1e12:.2f} TFLOP/s ({peaks})")
    save()
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds = timed(device, lambda: dst.copy_(src), reps, 5)
    result["copy_bytes"] = copy_bytes
    result["copy_bytes_per_s"] = 2 * copy_bytes / seconds  # each byte read once, written once
    log(f"device copy {result['copy_bytes_per_s'] / 1e9:.1f} GB/s")
    save()


# ---- one shape: train, decode, publish --------------------------------------------------

def random_batch(size: dict, seed: int):
    """`groups` random prompts, each with `samples` random answers (the loss tokens)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = size["answer"]
    rows = []
    for _ in range(size["groups"]):
        head = torch.randint(3, 250, (size["prompt"],), generator=g)
        for _ in range(size["samples"]):
            n = int(torch.randint(lo, hi + 1, (1,), generator=g))
            rows.append(torch.cat([head, torch.randint(3, 250, (n,), generator=g)]))
    return padded_batch(rows, [size["prompt"]] * len(rows))


def padded_batch(rows: list[torch.Tensor], prompts: list[int]):
    """A right-padded TensorBatch; loss tokens are those after each row's prompt."""
    from asyncrl.api.types import TensorBatch

    width = max(len(r) for r in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, :len(r)] = r
    lengths = torch.tensor([len(r) for r in rows])
    positions = torch.arange(width)[None, :]
    attention_mask = positions < lengths[:, None]
    loss_mask = (attention_mask & (positions >= torch.tensor(prompts)[:, None])).float()
    n = len(rows)
    return TensorBatch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask,
                       behavior_logprobs=torch.zeros(n, width),
                       versions=torch.zeros(n, width, dtype=torch.long), rewards=torch.zeros(n))


def nll(out: torch.Tensor, mb, *, n_tokens: int, n_seqs: int) -> tuple[torch.Tensor, dict]:
    """The token NLL over the loss tokens: a loss with the policy loss's cost."""
    return -(out * mb.loss_mask).sum() / n_tokens, {}


def peak_memory(device: str) -> int:
    """Peak bytes: the CUDA allocator's since its last reset, else the process's peak RSS."""
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def train(spec: dict, size: dict, out: dict, held: dict) -> None:
    """Training steps in bf16 through FSDPTrainEngine.train_batch; the engine goes into
    `held` once initialised (publishing needs it even if a step fails)."""
    from train_step import non_embedding_params

    from asyncrl.config.engine import MicroBatchSpec, TrainEngineSpec
    from asyncrl.trainer import FSDPTrainEngine

    device = spec["device"]
    t0 = time.perf_counter()
    engine = FSDPTrainEngine(TrainEngineSpec(
        path=spec["model"], dtype="bfloat16",
        device="cuda" if device.startswith("cuda") else "cpu",
        mb_spec=MicroBatchSpec(max_tokens_per_mb=size["max_tokens_per_mb"])),
        total_steps=size["warm_up"] + size["steps"] + 1)
    engine.initialize()
    held["trainer"] = engine
    if engine.device.type != torch.device(device).type:
        raise RuntimeError(f"the train engine took {engine.device}, not {device}: its MFU "
                           "would not be the device's")
    out["engine_device"] = str(engine.device)
    out["init_s"] = time.perf_counter() - t0
    log(f"train engine on {engine.device} in {out['init_s']:.1f}s")
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    batches = [random_batch(size, seed) for seed in range(size["warm_up"] + size["steps"])]
    for batch in batches[:size["warm_up"]]:
        engine.train_batch(batch, nll)
    times, tokens = [], []
    for batch in batches[size["warm_up"]:]:
        sync(device)
        t = time.perf_counter()
        stats = engine.train_batch(batch, nll)
        sync(device)
        times.append(time.perf_counter() - t)
        tokens.append(int(batch.attention_mask.sum()))
        log(f"train step {times[-1]:.3f}s, loss {stats['loss']:.3f}, {tokens[-1]} tokens")
    out |= {"params": non_embedding_params(engine), "tokens": statistics.mean(tokens),
            "step_s": statistics.mean(times), "step_times": times,
            "peak_memory_bytes": peak_memory(device), "micro_batches": stats["n_mbs"],
            "loss": stats["loss"]}


def weight_bytes(cfg) -> int:
    """Bytes of the weights one decode step reads: all but the input embedding's untied
    rows (a tied embedding is read whole as the output projection)."""
    from asyncrl.inference.server.model import hf_shapes

    shapes = hf_shapes(cfg)
    if not cfg.tie_word_embeddings:
        shapes.pop("model.embed_tokens.weight")
    return sum(torch.Size(s).numel() for s in shapes.values()) * 2  # bf16


def decode(engine, size: dict, batch: int, warm: bool) -> dict:
    """Generated tokens, seconds and bytes read by the decode steps of `batch` requests."""
    from asyncrl.api.types import GenerationRequest, SamplingParams
    from engine_vs_hf import prompts

    cfg = engine.model.cfg
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # k and v, bf16
    new_tokens = 4 if warm else size["new_tokens"]
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
    count = [0]
    for ids in prompts(engine.tokenizer, batch):
        engine.submit(GenerationRequest(input_ids=ids, sampling=sampling), lambda r: None,
                      on_token=lambda *_: count.__setitem__(0, count[0] + 1))
    engine.step()  # admission: prefill and the first tokens, not counted
    device = str(engine.device)
    sync(device)
    first, steps, kv_bytes = count[0], 0, 0
    t0 = time.perf_counter()
    while engine.stats()["running"] or engine.stats()["waiting"]:
        kv_bytes += sum(s.n_tokens for s in engine._active) * kv_per_token
        engine.step()
        steps += 1
    sync(device)
    seconds = time.perf_counter() - t0
    return {"batch": batch, "tokens": count[0] - first, "seconds": seconds, "steps": steps,
            "bytes": steps * weight_bytes(cfg) + kv_bytes, "weight_bytes": weight_bytes(cfg),
            "kv_bytes": kv_bytes}


class InProcessServer:
    """The inference-engine side of WeightPublisher over a LocalEngine in this process."""

    def __init__(self, engine) -> None:
        self.engine = engine

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        self.engine.update_weights(path, version)


def publish(trainer, server, spec: dict, size: dict, out: dict) -> None:
    """Publish the trainer's bf16 weights to a folder and load them into the local engine."""
    from asyncrl.weights import WeightPublisher

    root = Path(spec["work"], "weights")
    publisher = WeightPublisher(root, InProcessServer(server), dtype="bfloat16")
    saves, loads = [], []
    for version in range(1, size["publishes"] + 2):  # the first allocates: not counted
        stats = publisher.publish(trainer, version)
        if version > 1:
            saves.append(stats["perf/weights_save_s"])
            loads.append(stats["perf/weights_load_s"])
        log(f"publish v{version}: save {stats['perf/weights_save_s']:.3f}s, "
            f"load {stats['perf/weights_load_s']:.3f}s")
    folder = publisher.path(version)
    out |= {"save_s": statistics.mean(saves), "load_s": statistics.mean(loads),
            "bytes": sum(f.stat().st_size for f in folder.glob("*.safetensors")),
            "served_version": server.version, "published_version": version}


def digest_check(trainer, server, out: dict) -> None:
    """Whether the served weights are the trainer's bf16 weights, bit for bit."""
    from asyncrl.inference.server.model import Weights

    model = server.model
    expected = Weights(model.cfg, trainer.hf_state_dict(torch.bfloat16), torch.bfloat16,
                       model.device, pack=model.pack_mode()).digest()
    out["digest_equal"] = server.weights_digest()["sha256"] == expected


def logprob_gap(trainer, server, size: dict, out: dict) -> None:
    """Max and mean |trainer log-prob - server log-prob| of the server's sampled tokens."""
    from asyncrl.api.types import GenerationRequest, SamplingParams
    from engine_vs_hf import prompts

    sampling = SamplingParams(max_new_tokens=size["gap_tokens"], temperature=1.0,
                              ignore_eos=True, seed=1)
    done = []
    for ids in prompts(server.tokenizer, size["gap_rows"]):
        server.submit(GenerationRequest(input_ids=ids, sampling=sampling), done.append)
    while len(done) < size["gap_rows"]:
        server.step()
    for r in done:
        if isinstance(r, BaseException):
            raise r
    rows = [torch.tensor(r.input_ids + r.output_ids) for r in done]
    batch = padded_batch(rows, [len(r.input_ids) for r in done])
    ours = trainer.compute_logprobs(batch)
    gaps = torch.cat([(ours[i, len(r.input_ids):len(r.input_ids) + len(r.output_ids)]
                       - torch.tensor(r.output_logprobs)).abs() for i, r in enumerate(done)])
    out |= {"logprob_gap_max": float(gaps.max()), "logprob_gap_mean": float(gaps.mean()),
            "logprob_tokens": gaps.numel()}


def shape(spec: dict, result: dict, save: Callable[[], None]) -> None:
    """Training steps, decode at each batch size and publishing, for one model."""
    from asyncrl.config.schema import LocalEngineConfig
    from asyncrl.inference.server.engine import LocalEngine

    size = SIZES["tiny" if spec["tiny"] else "full"]
    held: dict = {}
    with part(result, "train", save) as out:
        train(spec, size, out, held)
    trainer, server = held.get("trainer"), None
    with part(result, "decode", save) as out:
        t0 = time.perf_counter()
        config = LocalEngineConfig(dtype="bfloat16", max_batch_size=max(size["decode_batches"]),
                                   max_seq_len=128 + size["new_tokens"])
        server = LocalEngine(spec["model"], config, device=spec["device"])
        out["init_s"] = time.perf_counter() - t0
        for batch in size["decode_batches"]:
            decode(server, size, batch, warm=True)
            # the fastest of `decode_runs`: tiny runs last milliseconds, where a shared
            # machine's stalls would decide the figure
            runs = [decode(server, size, batch, warm=False) for _ in range(size["decode_runs"])]
            out[f"batch_{batch}"] = run = max(runs, key=lambda r: r["tokens"] / r["seconds"])
            log(f"decode batch {batch}: {run['tokens'] / run['seconds']:.1f} tok/s")
            save()
    with part(result, "publish", save) as out:
        if trainer is None or server is None:
            raise RuntimeError("needs the train engine and the local engine: see their parts")
        publish(trainer, server, spec, size, out)
        save()
        if spec["digest"]:
            digest_check(trainer, server, out)
            save()
        logprob_gap(trainer, server, size, out)


class part:
    """Runs one part of a worker: its seconds, and its error with traceback, into the result."""

    def __init__(self, result: dict, name: str, save: Callable[[], None]) -> None:
        self.result, self.name, self.save = result, name, save
        result.setdefault(name, {})

    def __enter__(self) -> dict:
        log(f"--- {self.name}")
        self.t0 = time.perf_counter()
        self.result[self.name]["status"] = "started"  # what a crash or a kill leaves
        self.save()
        return self.result[self.name]

    def __exit__(self, kind, error, tb) -> bool:
        out = self.result[self.name]
        out["seconds"] = time.perf_counter() - self.t0
        out["status"] = "passed" if error is None else "failed"
        if error is not None:
            out["error"] = f"{kind.__name__}: {error}"
            out["traceback"] = "".join(traceback.format_exception(kind, error, tb))
            log(f"{self.name} failed:\n{out['traceback']}")
        self.save()
        return isinstance(error, Exception)  # a KeyboardInterrupt still stops the worker


# ---- lora and moe ------------------------------------------------------------------------

LORA = dict(rank=16, alpha=32, steps=2)  # two steps move the adapters off their zero start
# The Qwen3-MoE built by the `moe` worker: hidden 1024, 8 layers, 16 experts of 384, top 4
# (about 150M parameters) on a GPU; make_tiny_model's defaults (8 experts, top 2) on the CPU.
MOE_FULL = dict(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4, head_dim=64,
                intermediate_size=1024,
                moe={"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 384})


def train_spec(spec: dict, size: dict, **keys):
    """A bf16 TrainEngineSpec on the step's device."""
    from asyncrl.config.engine import MicroBatchSpec, OptimizerConfig, TrainEngineSpec

    return TrainEngineSpec(path=spec["model"], dtype="bfloat16",
                           device="cuda" if spec["device"].startswith("cuda") else "cpu",
                           optimizer=OptimizerConfig(lr=1e-3),
                           mb_spec=MicroBatchSpec(max_tokens_per_mb=size["max_tokens_per_mb"]),
                           **keys)


def local_engine(spec: dict, size: dict, rows: int):
    from asyncrl.config.schema import LocalEngineConfig
    from asyncrl.inference.server.engine import LocalEngine

    config = LocalEngineConfig(dtype="bfloat16", max_batch_size=rows,
                               max_seq_len=128 + size["gap_tokens"])
    return LocalEngine(spec["model"], config, device=spec["device"])


def lora(spec: dict, result: dict, save: Callable[[], None]) -> None:
    """LoRA (all-linear) in bf16: training steps, the adapters alone published as PEFT's
    folder, merged by the local engine, and its sampled log-probs against the trainer's."""
    from safetensors import safe_open

    from asyncrl.models import lora as lora_files
    from asyncrl.trainer import FSDPTrainEngine

    size = SIZES["tiny" if spec["tiny"] else "full"]
    with part(result, "lora", save) as out:
        trainer = FSDPTrainEngine(train_spec(spec, size, use_lora=True, lora_rank=LORA["rank"],
                                             lora_alpha=LORA["alpha"]), total_steps=4)
        trainer.initialize()
        for seed in range(LORA["steps"]):
            sync(spec["device"])
            t = time.perf_counter()
            stats = trainer.train_batch(random_batch(size, seed), nll)
            sync(spec["device"])
            out["step_s"] = time.perf_counter() - t
        folder = Path(spec["work"], "adapter")
        t = time.perf_counter()
        trainer.save_hf(str(folder), dtype=torch.bfloat16)
        out["save_s"] = time.perf_counter() - t
        with safe_open(folder / lora_files.WEIGHTS_FILE, "pt") as f:
            out["adapter_tensors"] = len(f.keys())
            out["adapter_tensor_bytes"] = sum(f.get_tensor(k).nbytes for k in f.keys())
        out["full_bytes"] = trainer._full_weight_bytes(torch.bfloat16)
        out["loss"] = stats["loss"]
        save()
        server = local_engine(spec, size, size["gap_rows"])
        t = time.perf_counter()
        server.update_weights(str(folder), version=1)
        out["load_s"] = time.perf_counter() - t
        out["served_version"] = server.version
        logprob_gap(trainer, server, size, out)
        log(f"lora: {out['adapter_tensor_bytes'] / 2**20:.2f} MiB of adapters, "
            f"max |dlogp| {out['logprob_gap_max']:.3g}")


def moe(spec: dict, result: dict, save: Callable[[], None]) -> None:
    """A Qwen3-MoE in bf16: completions sampled by the local engine with their routes, the
    trainer's log-probs on them with routing replay, and a training step (replay and the
    router load-balancing loss) that changes them."""
    from asyncrl.api.types import Batch, GenerationRequest, SamplingParams, Trajectory
    from asyncrl.models.tiny import make_tiny_model
    from asyncrl.trainer import FSDPTrainEngine

    size = SIZES["tiny" if spec["tiny"] else "full"]
    with part(result, "moe", save) as out:
        t = time.perf_counter()
        path = make_tiny_model(Path(spec["work"], "qwen3-moe"), arch="qwen3_moe",
                               **({} if spec["tiny"] else MOE_FULL))
        out["build_s"] = time.perf_counter() - t
        spec = spec | {"model": path}
        server = local_engine(spec, size, size["gap_rows"])
        sampling = SamplingParams(max_new_tokens=size["gap_tokens"], temperature=1.0,
                                  ignore_eos=True, seed=1)
        done = []
        for i in range(size["gap_rows"]):
            prompt = [10 + (7 * i + j) % 200 for j in range(8 + i)]
            server.submit(GenerationRequest(input_ids=prompt, sampling=sampling), done.append)
        while len(done) < size["gap_rows"]:
            server.step()
        server.close()
        batch = Batch([Trajectory.from_response(r, reward=0.0, group_id="g")
                       for r in done]).to_tensors()
        if batch.routed_experts is None:
            raise RuntimeError("the local engine recorded no routed experts")
        trainer = FSDPTrainEngine(train_spec(spec, size, routing_replay=True,
                                             router_aux_loss_coef=0.01), total_steps=2)
        trainer.initialize()
        out["params"] = sum(p.numel() for p in trainer.model.parameters())
        mask = batch.loss_mask > 0
        before = trainer.compute_logprobs(batch)
        gaps = (before - batch.behavior_logprobs)[mask].abs()
        out |= {"replay_gap_max": float(gaps.max()), "replay_gap_mean": float(gaps.mean()),
                "logprob_tokens": int(mask.sum())}
        sync(spec["device"])
        t = time.perf_counter()
        stats = trainer.train_batch(batch, nll)
        sync(spec["device"])
        out |= {"step_s": time.perf_counter() - t, "loss": stats["loss"],
                "router_aux_loss": stats["router_aux_loss"], "grad_norm": stats["grad_norm"],
                "peak_memory_bytes": peak_memory(spec["device"])}
        after = trainer.compute_logprobs(batch)
        out["logprob_change_max"] = float((after - before)[mask].abs().max())
        log(f"moe: replay gap {out['replay_gap_max']:.3g}, step {out['step_s']:.3f}s, "
            f"aux {out['router_aux_loss']:.4f}")


# ---- grpo -------------------------------------------------------------------------------

def grpo(spec: dict, result: dict, save: Callable[[], None]) -> None:
    """The async GRPO run of `grpo_one_gpu.run` (trainer and server on one device)."""
    sys.path.insert(0, str(HERE))
    import grpo_one_gpu

    Path(spec["work"]).mkdir(parents=True, exist_ok=True)
    row = grpo_one_gpu.run(device=spec["device"], model_dir=spec["model"],
                           out_dir=spec["work"], steps=spec["steps"], sync=spec["sync"])
    result["row"] = row


WORKERS = {"build": build, "calibrate": calibrate, "shape": shape, "lora": lora, "moe": moe,
           "grpo": grpo}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("worker", choices=sorted(WORKERS))
    p.add_argument("--spec", required=True, help="the worker's arguments, as JSON")
    p.add_argument("--result", required=True, type=Path)
    args = p.parse_args()
    spec = json.loads(args.spec)
    result: dict = {}

    def save() -> None:
        tmp = args.result.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=str))
        os.replace(tmp, args.result)

    log(f"{args.worker} {spec}")
    torch.manual_seed(0)
    with part(result, "worker", save):
        WORKERS[args.worker](spec, result, save)
    save()


if __name__ == "__main__":
    main()
