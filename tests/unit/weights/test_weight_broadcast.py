"""Weight sync by broadcast: trainer rank 0 -> our servers (subprocesses), bucket by bucket.

The servers run a tiny random model; the "trainer" is this process (or spawned ranks, or a
sender subprocess that is killed or stopped mid-broadcast). A server's /weights_checksum
is the sha256 of the buffers its forward reads, compared with `Weights` built here from
the same tensors: equal digests mean bit-identical weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import aiohttp
import pytest
import torch
from recorder import Recorder
from safetensors.torch import load_file
from serving import serving

from asyncrl.api import GenerationRequest, SamplingParams
from asyncrl.api.errors import InferenceError
from asyncrl.config.engine import TrainEngineSpec
from asyncrl.config.schema import ActorConfig
from asyncrl.inference.client import LocalServerClient
from asyncrl.inference.client.base import WeightUpdateError
from asyncrl.inference.client.sglang import SGLangClient
from asyncrl.inference.client.vllm import VLLMClient
from asyncrl.inference.server.model import Transformer, Weights
from asyncrl.models.tiny import make_tiny_model
from asyncrl.trainer.dist import free_port
from asyncrl.weights import (
    BroadcastPublisher,
    WeightPublisher,
    WeightSender,
    make_publisher,
    transfer_backend,
)
from asyncrl.weights.transport import BucketLayout

TIMEOUT = 4.0  # seconds for every step of an update (and each broadcast)
MARGIN = 2.0  # what an error may take beyond the timeout


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@contextlib.contextmanager
def server(model: str, dtype: str = "float32") -> Iterator[subprocess.Popen]:
    """Our inference server on a free loopback port (`proc.address`)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.inference.server.app", "--model", model, "--port", "0",
         "--dtype", dtype, "--threads", "1", "--max-batch-size", "4", "--max-seq-len", "256"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "listening on " in line:
                proc.address = line.rsplit("listening on ", 1)[1].strip()
                break
        else:
            raise RuntimeError("server did not start:\n" + "".join(seen[-20:]))
        yield proc
    finally:
        proc.kill()
        proc.wait()


def checksum(address: str) -> dict:
    with urllib.request.urlopen(address + "/weights_checksum", timeout=30) as r:
        return json.load(r)


def digest(model: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> str:
    """What a server of `model` in `dtype` holding `tensors` reports."""
    transformer = Transformer.from_pretrained(model, dtype=dtype, max_seq_len=16)
    return Weights(transformer.cfg, tensors, dtype, pack=transformer.pack_mode()).digest()


class Actor:
    """The trainer's side as the sender sees it: full weights under HF names."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def hf_state_dict(self, dtype=None):
        return {k: v.to(dtype, copy=True) for k, v in self.tensors.items()}


def perturbed(model: str, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.01 * torch.randn(v.shape, generator=g)
            for k, v in load_file(os.path.join(model, "model.safetensors")).items()}


def generate(client, version_expected: int) -> None:
    resp = asyncio.run(client.agenerate(GenerationRequest(
        input_ids=[1, 5, 6, 7], sampling=SamplingParams(max_new_tokens=3))))
    assert resp.output_versions == [version_expected] * 3


# ---- the wire format ------------------------------------------------------------------------

def test_buckets_close_once_past_the_size_and_big_tensors_go_alone():
    f32, bf16 = torch.float32, torch.bfloat16
    tensors = [("a", f32, [10]), ("b", f32, [6]), ("c", bf16, [50]), ("d", f32, [2])]
    # 40 bytes (under 50), + 24 = 64 (past it: closed); 100 alone; 8 in the last.
    layout = BucketLayout.plan(tensors, bucket_bytes=50)
    assert layout.buckets == (2, 1, 1)
    assert layout.offsets == (0, 40, 0, 0)
    assert layout.bucket_sizes() == [64, 100, 8]
    assert layout.buffer_sizes() == [64, 100]  # buckets 0 and 2 take turns with bucket 1
    assert BucketLayout.plan(tensors, bucket_bytes=1).buckets == (1, 1, 1, 1)
    assert BucketLayout.plan(tensors, bucket_bytes=10**9).buckets == (4,)


def test_layout_round_trips_through_the_body_and_unpacks_what_was_packed():
    tensors = {"odd": torch.arange(3, dtype=torch.bfloat16),  # 6 bytes: the next is misaligned
               "f32": torch.tensor([[1.5, -2.0], [3.0, 4.25]]),
               "h": torch.ones(5, dtype=torch.float16)}
    layout = BucketLayout.plan(((k, v.dtype, v.shape) for k, v in tensors.items()), 8)
    assert BucketLayout.from_body(json.loads(json.dumps(layout.to_body()))) == layout
    out = []
    for b, size in enumerate(layout.bucket_sizes()):
        data = torch.empty(size, dtype=torch.uint8)
        layout.pack(b, list(tensors.values()), data)
        out += list(layout.unpack(b, data))
    assert [n for n, _ in out] == list(tensors)
    for (_, got), want in zip(out, tensors.values()):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_layout_body_without_buckets_means_what_sglang_means():
    body = {"names": ["a", "b"], "dtypes": ["float32", "torch.bfloat16"], "shapes": [[2], [3]]}
    assert BucketLayout.from_body(body).buckets == (1, 1)  # one broadcast per tensor
    flat = BucketLayout.from_body(body | {"load_format": "flattened_bucket"})
    assert flat.buckets == (2,) and flat.offsets == (0, 8)


@pytest.mark.parametrize("change, message", [
    ({"dtypes": ["float32", "int8"]}, "dtypes \\['int8'\\]"),
    ({"shapes": [[2], [-3]]}, "shapes must be"),
    ({"buckets": [1]}, "summing to 2"),
    ({"offsets": [0, 4]}, "b at byte 4 overlaps a"),
])
def test_bad_layout_bodies_are_refused_naming_the_field(change, message):
    body = {"names": ["a", "b"], "dtypes": ["float32", "float32"], "shapes": [[2], [3]],
            "buckets": [2]} | change
    with pytest.raises(ValueError, match=message):
        BucketLayout.from_body(body)


# ---- our server -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, bucket_bytes", [
    ("float32", 1),  # every tensor its own bucket (smaller than any tensor)
    ("bfloat16", 1 << 30),  # one bucket larger than all the weights
    ("bfloat16", 20_000),  # several, each past the size by one tensor
])
def test_broadcast_serves_exactly_the_trainers_weights_as_the_new_version(tiny, dtype,
                                                                          bucket_bytes, tmp_path):
    torch_dtype = getattr(torch, dtype)
    with server(tiny, dtype) as proc:
        client = LocalServerClient([proc.address], update_weights_timeout=TIMEOUT)
        publisher = BroadcastPublisher(client, dtype=dtype, timeout=TIMEOUT)
        publisher.bucket_bytes = bucket_bytes
        try:
            for version in (1, 2):  # the second reuses the group and the spare buffers
                weights = perturbed(tiny, seed=version)
                stats = publisher.publish(Actor(weights), version)
                got = checksum(proc.address)
                assert got == {"version": version,
                               "sha256": digest(tiny, weights, torch_dtype)}
                assert ("perf/weights_connect_s" in stats) == (version == 1)
                generate(client, version)
            # The disk path lands on the same bytes.
            WeightPublisher(tmp_path, client, dtype=dtype).publish(_Saver(tiny, weights), 3)
            assert checksum(proc.address) == {"version": 3, "sha256": got["sha256"]}
        finally:
            publisher.close()
            asyncio.run(client.close())


class _Saver:
    """An actor for the disk publisher: writes `tensors` as an HF folder of `model`."""

    def __init__(self, model: str, tensors: dict[str, torch.Tensor]):
        self.model, self.tensors = model, tensors

    def save_hf(self, path: str, dtype=None) -> None:
        import shutil

        from safetensors.torch import save_file

        os.makedirs(path)
        save_file({k: v.to(dtype).contiguous() for k, v in self.tensors.items()},
                  os.path.join(path, "model.safetensors"))
        shutil.copy(os.path.join(self.model, "config.json"), path)


def test_a_killed_server_is_an_error_naming_it_within_the_timeout_and_the_next_publish_works(
        tiny):
    with server(tiny) as a, server(tiny) as b:
        client = LocalServerClient([a.address, b.address], update_weights_timeout=TIMEOUT,
                                       request_retries=0)
        publisher = BroadcastPublisher(client, dtype="float32", timeout=TIMEOUT)
        publisher.bucket_bytes = 4096
        try:
            publisher.publish(Actor(perturbed(tiny, 1)), 1)
            b.kill()
            b.wait()
            t0 = time.monotonic()
            with pytest.raises(InferenceError, match=b.address):
                publisher.publish(Actor(perturbed(tiny, 2)), 2)
            assert time.monotonic() - t0 < TIMEOUT + MARGIN
            assert checksum(a.address)["version"] in (1, 2)  # whole weights either way
            weights = perturbed(tiny, 3)
            publisher.publish(Actor(weights), 3)  # a new group, of the live server
            assert client.weight_group == [a.address]
            assert checksum(a.address) == {"version": 3,
                                           "sha256": digest(tiny, weights, torch.float32)}
            generate(client, 3)
        finally:
            publisher.close()
            asyncio.run(client.close())


SENDER = """
import os, signal, sys, torch
from safetensors.torch import load_file
from asyncrl.weights import transport
from asyncrl.weights.broadcast import WeightSender

address, port, world, model, bucket, how, name, timeout = sys.argv[1:]
tensors = {k: v + 1.0 for k, v in load_file(os.path.join(model, "model.safetensors")).items()}

class Actor:
    def hf_state_dict(self, dtype=None):
        return tensors

real, sent = transport.broadcast, []
def broadcast(group, tensor, timeout):  # the second bucket never leaves
    if sent:
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    sent.append(1)
    return real(group, tensor, timeout)
transport.broadcast = broadcast

sender = WeightSender(0, dtype=torch.float32)
sender.connect(address, int(port), int(world), float(timeout), group_name=name)
sender.send(Actor(), bucket_bytes=int(bucket))
"""


@pytest.mark.parametrize("how", ["kill", pytest.param("stop", marks=pytest.mark.slow)])
def test_a_trainer_gone_mid_broadcast_leaves_the_old_weights_served_then_an_update_works(
        tiny, how):
    tensors = load_file(os.path.join(tiny, "model.safetensors"))
    bucket = 4096
    layout = BucketLayout.plan(((k, v.dtype, v.shape) for k, v in tensors.items()), bucket)
    assert len(layout.buckets) > 2
    with server(tiny) as proc:
        before = checksum(proc.address)
        client = LocalServerClient([proc.address], update_weights_timeout=TIMEOUT)
        port, name = free_port(), f"test_{how}"
        sender = subprocess.Popen([sys.executable, "-c", SENDER, "127.0.0.1", str(port), "2",
                                   tiny, str(bucket), how, name, str(TIMEOUT)])
        try:
            asyncio.run(client.init_weights_update_group(
                "127.0.0.1", port, servers=[proc.address], bucket_bytes=bucket,
                group_name=name))
            t0 = time.monotonic()
            with pytest.raises(WeightUpdateError, match=proc.address):
                asyncio.run(client.update_weights_from_distributed(layout.to_body(), 1,
                                                                   group_name=name))
            # died: the server notices at once; stopped: when its timeout runs out
            assert time.monotonic() - t0 < (1.0 if how == "kill" else TIMEOUT + MARGIN)
            time.sleep(0.2 if how == "kill" else TIMEOUT)  # the server's side has given up
            assert checksum(proc.address) == before  # old weights, old version
            generate(client, 0)  # and it serves (resumed by the client)

            publisher = BroadcastPublisher(client, dtype="float32", timeout=TIMEOUT)
            weights = perturbed(tiny, 5)
            publisher.publish(Actor(weights), 1)
            publisher.close()
            assert checksum(proc.address) == {"version": 1,
                                              "sha256": digest(tiny, weights, torch.float32)}
        finally:
            sender.kill()
            sender.wait()
            asyncio.run(client.close())


def _two_rank_worker(rank: int, port: int, model: str, address: str, out: str) -> None:
    from asyncrl.trainer import FSDPTrainEngine

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    engine = FSDPTrainEngine(TrainEngineSpec(path=model, dtype="float32"), total_steps=1)
    engine.initialize()
    with torch.no_grad():  # weights the server cannot have yet
        for p in engine.model.parameters():
            p.add_(0.125)
    if rank == 0:
        client = LocalServerClient([address], update_weights_timeout=30)
        publisher = BroadcastPublisher(client, dtype="float32", timeout=30)
        publisher.bucket_bytes = 8192
        publisher.publish(engine, 1)
        publisher.close()
        asyncio.run(client.close())
    else:
        WeightSender(rank, dtype=torch.float32).send(engine, bucket_bytes=8192)
    weights = engine.hf_state_dict(torch.float32)  # a collective: both ranks
    if rank == 0:
        torch.save(weights, out)
    engine.destroy()


def test_two_trainer_ranks_gather_in_lockstep_and_rank_0_broadcasts(tiny, tmp_path):
    with server(tiny) as proc:
        out = str(tmp_path / "weights.pt")
        torch.multiprocessing.spawn(_two_rank_worker,
                                    args=(free_port(), tiny, proc.address, out), nprocs=2)
        assert checksum(proc.address) == {
            "version": 1, "sha256": digest(tiny, torch.load(out), torch.float32)}


def test_server_refuses_updates_it_cannot_take_and_keeps_serving(tiny):
    from asyncrl.inference.server.app import InferenceServer
    from asyncrl.inference.server.engine import LocalEngine

    engine = LocalEngine(tiny)
    engine.start()
    try:
        app = InferenceServer(engine, model_name="tiny").app
        with serving(app) as url:
            async def post(path: str, body: dict) -> tuple[int, dict]:
                async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
                    return r.status, await r.json()

            body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
                    "weight_version": "1", "load_format": "flattened_bucket"}
            status, answer = asyncio.run(post("/update_weights_from_distributed", body))
            assert status == 400 and answer["success"] is False
            assert "no weight-update group" in answer["message"]
            status, answer = asyncio.run(post("/update_weights_from_distributed",
                                              body | {"weight_version": "v1"}))
            assert status == 400 and "weight_version must be an integer" in answer["error"]
            status, answer = asyncio.run(post("/init_weights_update_group", {
                "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                "world_size": 2, "backend": "nccl"}))
            assert status == 400 and "backend must be 'gloo'" in answer["error"]
        assert engine.stats()["version"] == 0
    finally:
        engine.close()


# ---- vLLM's and SGLang's endpoints (recorded by a loopback stand-in) ----------------------------



LAYOUT = BucketLayout.plan([("w.a", torch.bfloat16, [4, 4]), ("w.b", torch.bfloat16, [8]),
                            ("w.c", torch.float32, [3])], bucket_bytes=40).to_body()


def test_vllm_client_speaks_vllms_weight_transfer_api():
    nccl = pytest.importorskip("vllm.distributed.weight_transfer.nccl_engine")
    recorder = Recorder()
    with serving(recorder.app) as url:
        client = VLLMClient([url], update_weights_timeout=5)
        asyncio.run(client.init_weights_update_group("10.0.0.1", 29500, servers=[url],
                                                     bucket_bytes=40))
        asyncio.run(client.update_weights_from_distributed(LAYOUT, 7))
        asyncio.run(client.destroy_weights_update_group())
        asyncio.run(client.close())
    paths = [p for p, _ in recorder.calls]
    assert paths == ["/init_weight_transfer_engine", "/pause?mode=abort", "/start_weight_update",
                     "/update_weights", "/finish_weight_update", "/resume",
                     "/shutdown_weight_transfer_engine"]
    bodies = dict(recorder.calls)
    init = bodies["/init_weight_transfer_engine"]["init_info"]
    assert init == {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1,
                    "world_size": 2, "packed": True, "packed_buffer_size_bytes": 40,
                    "packed_num_buffers": 2}
    nccl.NCCLWeightTransferInitInfo(**init)  # vLLM's own parsing of both bodies
    update = bodies["/update_weights"]["update_info"]
    nccl.NCCLWeightTransferUpdateInfo(**update)
    assert update == {"names": ["w.a", "w.b", "w.c"],
                      "dtype_names": ["bfloat16", "bfloat16", "float32"],
                      "shapes": [[4, 4], [8], [3]]}
    assert bodies["/finish_weight_update"] == {"weight_version": "7"}


def test_vllm_cuts_the_buckets_where_ours_are():
    packed = pytest.importorskip("vllm.distributed.weight_transfer.packed_tensor")
    layout = BucketLayout.from_body(LAYOUT)
    tensors = [torch.full(s, i + 1.0, dtype=getattr(torch, d))
               for i, (s, d) in enumerate(zip(layout.shapes, layout.dtypes))]
    chunks, it = [], iter(zip(layout.names, tensors))
    while (chunk := packed.pack_tensors(it, lambda item: item[1], 40)) is not None:
        chunks.append(chunk)
    assert [len(c.names) for c in chunks] == list(layout.buckets)
    for b, chunk in enumerate(chunks):
        ours = torch.empty(layout.bucket_sizes()[b], dtype=torch.uint8)
        layout.pack(b, tensors, ours)
        assert torch.equal(ours, chunk.packed_tensor)


def test_sglang_client_sends_one_flattened_bucket_per_request():
    recorder = Recorder()
    with serving(recorder.app) as url:
        client = SGLangClient([url], update_weights_timeout=5)
        asyncio.run(client.init_weights_update_group("10.0.0.1", 29500, servers=[url],
                                                     bucket_bytes=40, group_name="g"))
        asyncio.run(client.update_weights_from_distributed(LAYOUT, 7, group_name="g"))
        asyncio.run(client.close())
    assert recorder.calls[0] == ("/init_weights_update_group", {
        "master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2,
        "group_name": "g", "backend": "gloo"})
    assert [p for p, _ in recorder.calls[1:]] == [
        "/pause_generation", "/update_weights_from_distributed",
        "/update_weights_from_distributed", "/continue_generation"]
    first, last = recorder.calls[2][1], recorder.calls[3][1]
    assert first == {"names": ["w.a", "w.b"], "dtypes": ["bfloat16", "bfloat16"],
                     "shapes": [[4, 4], [8]], "group_name": "g",
                     "load_format": "flattened_bucket", "flush_cache": False}
    assert last == {"names": ["w.c"], "dtypes": ["float32"], "shapes": [[3]], "group_name": "g",
                    "load_format": "flattened_bucket", "flush_cache": True,
                    "weight_version": "7"}


# ---- configuration --------------------------------------------------------------------------

def test_weight_update_mode_is_checked_and_picks_the_publisher(tmp_path):
    with pytest.raises(ValueError, match="actor.weight_update_mode"):
        ActorConfig(weight_update_mode="ftp")
    with pytest.raises(ValueError, match="actor.weight_update_bucket_mb"):
        ActorConfig(weight_update_bucket_mb=0)
    client = LocalServerClient(["127.0.0.1:1"])
    assert isinstance(make_publisher("disk", client, root=tmp_path), WeightPublisher)
    broadcast = make_publisher("broadcast", client, root=tmp_path, bucket_mb=16, timeout=9)
    assert isinstance(broadcast, BroadcastPublisher)
    assert (broadcast.bucket_bytes, broadcast.timeout, broadcast.sender.backend) == (
        16 << 20, 9, "gloo")
    assert [transfer_backend(b, cuda=True) for b in ("local", "sglang", "vllm")] == [
        "gloo", "nccl", "vllm"]
