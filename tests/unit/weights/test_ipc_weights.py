"""Weights by CUDA IPC (weights/ipc.py), run on the CPU: every part but the two CUDA calls.

`share` and `open_shared` (cudaIpcGetMemHandle / cudaIpcOpenMemHandle through torch) need a
GPU; here a registry stands in for them, handing the server the trainer's very buffer, so
the handle's JSON form, the packing, the server's route and its copy into the engine's
weights, the clients, and vLLM's parsing of our bodies are all checked with numbers.
"""

import asyncio
import itertools
import json
import os
import subprocess
import sys

import pytest
import requests
import torch
from recorder import Recorder
from serving import serving

from asyncrl.api import Batch, GenerationRequest, SamplingParams, Trajectory
from asyncrl.config import LocalEngineConfig, load_config
from asyncrl.config.engine import TrainEngineSpec
from asyncrl.controller.specs import build_trainer_spec
from asyncrl.inference.client import LocalServerClient
from asyncrl.inference.client.base import WeightIpc
from asyncrl.inference.client.vllm import VLLMClient, ipc_update_info
from asyncrl.inference.server.app import InferenceServer
from asyncrl.inference.server.engine import LocalEngine
from asyncrl.trainer import FSDPTrainEngine
from asyncrl.trainer.service import TrainingService
from asyncrl.trainer.worker import RLWorker
from asyncrl.weights import ipc
from asyncrl.weights.ipc import (
    IpcExporter,
    IpcHandle,
    IpcImporter,
    IpcPublisher,
    parse_update,
)

# bf16 compute on both sides: about 3 significant digits on log-probs of magnitude ~5
# (test_train_engine's bf16 tolerance).
BF16_LOGPROB_TOL = 0.1


class FakeCuda:
    """Stands in for CUDA IPC: `share` files a buffer under a fresh handle, `open` finds it."""

    def __init__(self):
        self.buffers: dict[tuple[bytes, int], torch.Tensor] = {}
        self.opened: list[tuple[bytes, int]] = []

    def share(self, buffer: torch.Tensor) -> IpcHandle:
        handle = IpcHandle(gpu_uuid="GPU-test", device=0, nbytes=buffer.numel(), tensor_offset=0,
                           storage_handle=os.urandom(64), storage_size_bytes=buffer.numel(),
                           storage_offset_bytes=0, ref_counter_handle=os.urandom(8),
                           ref_counter_offset=0, event_handle=os.urandom(64),
                           event_sync_required=True)
        self.buffers[handle.key] = buffer
        return handle

    def open(self, handle: IpcHandle, device: torch.device) -> torch.Tensor:
        self.opened.append(handle.key)
        return self.buffers[handle.key]


# what torch's reduce_tensor gives for a 1000-byte uint8 slice of a shared allocation
TORCH_ARGS = (torch.Tensor, torch.Size([1000]), (1,), 24, torch.storage.TypedStorage,
              torch.uint8, 3, b"\x01" * 64, 2 << 20, 512, False, b"\x02" * 64, 7, b"\x03" * 64,
              True)


def test_a_handle_round_trips_through_json_into_torchs_rebuild_arguments():
    handle = IpcHandle.from_rebuild_args(TORCH_ARGS, "GPU-1234")
    again = IpcHandle.from_json(json.loads(json.dumps(handle.to_json())))
    assert again == handle
    assert again.rebuild_args() == TORCH_ARGS
    # The importer rebuilds on its own device index (vLLM overwrites argument 6 the same way).
    assert ipc._REBUILD_PARAMS[6] == "storage_device"
    assert again.rebuild_args(device=0) == TORCH_ARGS[:6] + (0,) + TORCH_ARGS[7:]
    assert (handle.nbytes, handle.tensor_offset, handle.key) == (1000, 24, (b"\x01" * 64, 512))


@pytest.mark.parametrize("change, message", [
    ({"storage_handle": None}, "ipc_handle.storage_handle must be base64 text"),
    ({"nbytes": -1}, "ipc_handle.nbytes must be a non-negative integer, got -1"),
    ({"device": True}, "ipc_handle.device must be a non-negative integer"),
    ({"event_sync_required": "yes"}, "ipc_handle.event_sync_required must be a bool"),
    ({"pointer": 5}, r"ipc_handle has unknown fields \['pointer'\]"),
])
def test_a_bad_handle_names_its_field(change, message):
    body = IpcHandle.from_rebuild_args(TORCH_ARGS, "GPU-1").to_json() | change
    with pytest.raises(ValueError, match=message):
        IpcHandle.from_json(body)


def test_a_non_byte_buffer_is_refused():
    args = TORCH_ARGS[:5] + (torch.bfloat16,) + TORCH_ARGS[6:]
    with pytest.raises(ValueError, match="an IPC buffer is a 1-D uint8 tensor"):
        IpcHandle.from_rebuild_args(args, "GPU-1")


def _state(scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {"a.weight": torch.arange(12, dtype=torch.bfloat16).view(3, 4) * scale,
            "b.bias": torch.full((5,), -2.5 * scale, dtype=torch.bfloat16),
            "c.weight": torch.linspace(0, 1, 6, dtype=torch.float32).view(2, 3) * scale}


def test_the_exporter_lays_tensors_end_to_end_and_shares_its_buffer_once():
    cuda = FakeCuda()
    exporter = IpcExporter(share=cuda.share)
    body = exporter.export(_state())
    layout, handle = parse_update(body)
    # 12 + 5 bf16 elements, then 6 float32: offsets 0, 24, 34; 58 bytes in one bucket
    assert list(layout.offsets) == [0, 24, 34] and list(layout.buckets) == [3]
    assert layout.bucket_sizes() == [58] and handle.nbytes == 58
    buffer = cuda.buffers[handle.key]
    for (name, t), want in zip(layout.unpack(0, buffer), _state().values()):
        assert torch.equal(t, want), name
    # The next publish rewrites the same buffer under the same handle.
    again = exporter.export(_state(scale=2.0))
    assert again["ipc_handle"] == body["ipc_handle"] and len(cuda.buffers) == 1
    assert torch.equal(dict(layout.unpack(0, buffer))["b.bias"],
                       torch.full((5,), -5.0, dtype=torch.bfloat16))
    # Weights that no longer fit get a new buffer and a new handle.
    bigger = _state() | {"d.weight": torch.zeros(100, dtype=torch.bfloat16)}
    assert exporter.export(bigger)["ipc_handle"] != body["ipc_handle"]
    assert len(cuda.buffers) == 2


def test_the_importer_opens_each_handle_once():
    cuda = FakeCuda()
    first, second = (IpcExporter(share=cuda.share).export(_state()) for _ in range(2))
    importer = IpcImporter(open=cuda.open)
    for body in (first, first, second, second, first):
        importer.open(parse_update(body)[1], torch.device("cpu"))
    keys = [parse_update(b)[1].key for b in (first, second, first)]
    assert cuda.opened == keys


def test_an_update_body_that_does_not_fit_its_buffer_is_refused():
    body = IpcExporter(share=FakeCuda().share).export(_state())
    with pytest.raises(ValueError, match="buckets must be \\[3\\]"):
        parse_update(body | {"buckets": [2, 1]})
    small = body["ipc_handle"] | {"nbytes": 40}
    with pytest.raises(ValueError, match="the layout needs 58 bytes but the shared buffer "
                                         "holds 40"):
        parse_update(body | {"ipc_handle": small})


def test_open_shared_refuses_a_cpu_engine_naming_the_mode_to_use():
    handle = IpcHandle.from_rebuild_args(TORCH_ARGS, "GPU-1")
    with pytest.raises(ipc.IpcUnavailable, match="use actor.weight_update_mode=disk"):
        ipc.open_shared(handle, torch.device("cpu"))
    with pytest.raises(ipc.IpcUnavailable, match="CUDA IPC shares GPU memory"):
        ipc.share(torch.zeros(4, dtype=torch.uint8))


# ---- the trainer's weights into our server ----------------------------------------------------


def _sampled(client, n: int = 4) -> Batch:
    params = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True)

    async def go():
        return await asyncio.gather(*(client.agenerate(GenerationRequest(
            input_ids=[1, 60 + i, 61, 62], sampling=params)) for i in range(n)))

    return Batch([Trajectory.from_response(r, reward=float(i), group_id="g")
                  for i, r in enumerate(asyncio.run(go()))])


def _train_one_step(actor, batch: Batch) -> None:
    def loss_fn(logprobs, mb, *, n_tokens, n_seqs):
        return -(logprobs * mb.loss_mask).sum() / n_tokens, {}

    actor.train_batch(batch.to_tensors(), loss_fn)


@pytest.fixture(scope="module")
def trainer(process_group, tiny_path):
    cfg = load_config(None, ["train_dataset.path=x", f"actor.path={tiny_path}",
                             "actor.dtype=bfloat16", "actor.optimizer.lr=0.05"])
    actor = FSDPTrainEngine(TrainEngineSpec.of(cfg.actor), total_steps=10, seed=0)
    actor.initialize()
    yield actor
    actor.destroy()


ENGINE = LocalEngineConfig(dtype="bfloat16", max_batch_size=4, max_seq_len=128)


def test_weights_copied_by_ipc_equal_the_trainers_and_give_its_logprobs(trainer, tiny_path,
                                                                       tmp_path):
    cuda = FakeCuda()
    engine = LocalEngine(tiny_path, ENGINE)
    engine.start()
    server = InferenceServer(engine, model_name="tiny")
    server.ipc = IpcImporter(open=cuda.open)

    class Actor:  # RLWorker.ipc_weights, with the stand-in for CUDA's export
        exporter = IpcExporter(share=cuda.share)

        def ipc_weights(self, dtype):
            return self.exporter.export(trainer.device_state_dict(getattr(torch, dtype)))

    try:
        with serving(server.app) as url:
            client = LocalServerClient([url], update_weights_timeout=60)
            publisher = IpcPublisher(client, dtype="bfloat16", run=asyncio.run)
            for version in (1, 2):
                _train_one_step(trainer, _sampled(client))
                before = engine.weights_digest()["sha256"]
                stats = publisher.publish(Actor(), version)
                assert set(stats) == {"perf/weights_export_s", "perf/weights_load_s"}
                # the same bytes as the trainer's weights loaded from a bf16 folder
                folder = tmp_path / f"v{version}"
                trainer.save_hf(str(folder), dtype=torch.bfloat16)
                reference = LocalEngine(str(folder), ENGINE)
                served = engine.weights_digest()
                assert served == {"version": version,
                                  "sha256": reference.weights_digest()["sha256"]}
                assert served["sha256"] != before
                # tokens the server samples now: the trainer gives them the same log-probs
                batch = _sampled(client)
                tb = batch.to_tensors()
                mask = tb.loss_mask.bool()
                assert (tb.versions[mask] == version).all()
                gap = (trainer.compute_logprobs(tb)[mask] - tb.behavior_logprobs[mask]).abs()
                assert mask.sum() == 4 * 16 and gap.max() < BF16_LOGPROB_TOL, gap.max()
            asyncio.run(client.close())
    finally:
        engine.close()
    # one buffer, exported once and opened once, carried both versions
    assert len(cuda.buffers) == 1 and len(cuda.opened) == 1


def test_a_cpu_trainer_rank_refuses_to_export_naming_disk(tiny_path):
    cfg = load_config(None, [f"actor.path={tiny_path}", "train_dataset.path=x",
                             "actor.dtype=float32"])
    worker = RLWorker(build_trainer_spec(cfg))
    service = TrainingService(worker)
    try:
        with serving(service.app) as url:
            assert requests.post(url + "/initialize", json={"total_steps": 1},
                                 timeout=60).status_code == 200
            r = requests.post(url + "/weights/ipc", json={"dtype": "bfloat16"}, timeout=60)
            assert r.status_code == 400
            assert "this trainer rank runs on cpu" in r.json()["error"]
            assert "use actor.weight_update_mode=disk" in r.json()["error"]
            r = requests.post(url + "/weights/ipc", json={"dtype": "int8"}, timeout=60)
            assert r.status_code == 400 and "dtype 'int8' is not one of" in r.json()["error"]
    finally:
        worker.destroy()


def test_a_failed_ipc_update_keeps_the_served_weights_and_says_why(tiny_path):
    engine = LocalEngine(tiny_path, ENGINE)
    engine.start()
    server = InferenceServer(engine, model_name="tiny")  # the real CUDA opener: CPU engine
    before = engine.weights_digest()
    body = IpcExporter(share=FakeCuda().share).export(
        {"model.norm.weight": torch.ones(64, dtype=torch.bfloat16)})
    try:
        with serving(server.app) as url:
            client = LocalServerClient([url], update_weights_timeout=10, request_retries=0)
            with pytest.raises(Exception, match="does not fit the model: missing tensors"):
                asyncio.run(client.update_weights_from_ipc(body, 1))
            full = IpcExporter(share=FakeCuda().share).export(
                {n: torch.zeros(s, dtype=torch.bfloat16)
                 for n, s in engine.model.w._shapes.items()})
            with pytest.raises(Exception, match="this engine runs on cpu: CUDA IPC needs the "
                                                "server on the trainer's GPU"):
                asyncio.run(client.update_weights_from_ipc(full, 1))
            assert asyncio.run(client.health())[0]["paused"] is False  # resumed
            asyncio.run(client.close())
    finally:
        engine.close()
    assert engine.weights_digest() == before


def test_a_server_back_from_the_dead_rejoins_with_the_next_ipc_update():
    recorder = Recorder()
    with serving(recorder.app) as url:
        client = LocalServerClient([url], update_weights_timeout=5)
        client._mark_down(0, "restarted")
        body = IpcExporter(share=FakeCuda().share).export(_state())
        asyncio.run(client.update_weights_from_ipc(body, 3))
        assert client.live_servers == [url] and client._versions == [3]
        asyncio.run(client.close())
    paths = [p for p, _ in recorder.calls]
    assert paths == ["/health", "/pause", "/update_weights_from_ipc", "/resume"]
    sent = dict(recorder.calls)["/update_weights_from_ipc"]
    assert sent == body | {"weight_version": "3"}


# ---- vLLM's IPC weight transfer ---------------------------------------------------------------




def _bf16_state() -> dict[str, torch.Tensor]:
    """As the trainer exports them: every tensor in one dtype."""
    return {name: t.to(torch.bfloat16) for name, t in _state().items()}


def test_vllm_parses_our_ipc_body_into_our_handle_and_unpacks_our_buffer(monkeypatch):
    engine = pytest.importorskip("vllm.distributed.weight_transfer.ipc_engine")
    packed = pytest.importorskip("vllm.distributed.weight_transfer.packed_tensor")
    cuda = FakeCuda()
    body = IpcExporter(share=cuda.share).export(_bf16_state())
    info = ipc_update_info(WeightIpc(body))
    with pytest.raises(ValueError, match="VLLM_ALLOW_INSECURE_SERIALIZATION=1"):
        engine.IPCWeightTransferUpdateInfo(**info)  # why the launch sets it for ipc
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    parsed = engine.IPCWeightTransferUpdateInfo(**json.loads(json.dumps(info)))
    handle = IpcHandle.from_json(body["ipc_handle"])
    assert parsed.ipc_handles == {"GPU-test": handle.rebuild_args()}
    assert engine.IPCWeightTransferInitInfo(packed=True).packed
    # What vLLM's packed consumer does with the buffer the handle maps: split it by sizes.
    buffer = cuda.buffers[handle.key]
    tensors = packed.unpack_tensor(buffer[:sum(parsed.tensor_sizes)], parsed.names,
                                   parsed.shapes, [getattr(torch, d) for d in parsed.dtype_names],
                                   parsed.tensor_sizes)
    assert [n for n, _ in tensors] == list(_state())
    for (name, t), want in zip(tensors, _bf16_state().values()):
        assert torch.equal(t, want), name


def test_vllm_refuses_a_layout_it_cannot_view():
    body = IpcExporter(share=FakeCuda().share).export(_state())
    # mixed dtypes end to end: float32 c at byte 34 (vLLM's in-place view fails there)
    with pytest.raises(ValueError, match=r"c.weight \(float32\) starts at byte 34"):
        ipc_update_info(WeightIpc(body))
    gapped = body | {"offsets": [0, 32, 48]}  # aligned, but with gaps
    with pytest.raises(ValueError, match="end to end from byte 0"):
        ipc_update_info(WeightIpc(gapped | {"ipc_handle": body["ipc_handle"] | {"nbytes": 80}}))


def test_vllm_client_speaks_vllms_ipc_weight_transfer():
    pytest.importorskip("vllm.distributed.weight_transfer.ipc_engine")
    recorder = Recorder()
    body = IpcExporter(share=FakeCuda().share).export(_bf16_state())
    with serving(recorder.app) as url:
        client = VLLMClient([url], update_weights_timeout=5)
        asyncio.run(client.update_weights_from_ipc(body, 7))
        asyncio.run(client.close())
    paths = [p for p, _ in recorder.calls]
    assert paths == ["/pause?mode=abort", "/init_weight_transfer_engine", "/start_weight_update",
                     "/update_weights", "/finish_weight_update", "/resume"]
    bodies = dict(recorder.calls)
    assert bodies["/init_weight_transfer_engine"] == {"init_info": {"packed": True}}
    sent = bodies["/update_weights"]["update_info"]
    assert sent == ipc_update_info(WeightIpc(body))
    assert sent["tensor_sizes"] == [24, 10, 12]  # 12, 5 and 6 bf16 elements
    assert list(itertools.accumulate(sent["tensor_sizes"])) == [24, 34, 46]
    assert bodies["/finish_weight_update"] == {"weight_version": "7"}


# ---- on a GPU: the two CUDA calls themselves --------------------------------------------------

_OPEN_IN_ANOTHER_PROCESS = """
import json, sys, torch
from asyncrl.weights import ipc
importer = ipc.IpcImporter()
for line in sys.stdin:  # one update body a line; the sums of its tensors back
    layout, handle = ipc.parse_update(json.loads(line))
    buffer = importer.open(handle, torch.device("cuda"))
    sums = {n: t.double().sum().item() for n, t in layout.unpack(0, buffer)}
    print(json.dumps(sums), flush=True)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_cuda_ipc_hands_the_buffer_to_another_process_and_its_rewrites_too():
    exporter = IpcExporter()
    child = subprocess.Popen([sys.executable, "-c", _OPEN_IN_ANOTHER_PROCESS],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        for scale in (1.0, -3.0):  # the second export rewrites the same shared buffer
            state = {n: t.cuda() for n, t in _bf16_state().items()}
            state = {n: t * scale for n, t in state.items()}
            child.stdin.write(json.dumps(exporter.export(state)) + "\n")
            child.stdin.flush()
            sums = json.loads(child.stdout.readline())
            assert sums == {n: t.double().sum().item() for n, t in state.items()}
    finally:
        child.stdin.close()
        child.wait(60)
    assert child.returncode == 0
