"""The local engine's KV cache sized from a byte budget (inference/server/memory.py)."""

import pytest
import torch

from asyncrl.api import GenerationRequest, SamplingParams
from asyncrl.config import LocalEngineConfig
from asyncrl.inference.server import memory
from asyncrl.inference.server.app import parse_args
from asyncrl.inference.server.engine import LocalEngine
from asyncrl.inference.server.model import load_config


def test_a_slot_holds_keys_and_values_of_every_layer_over_max_seq_len():
    # Qwen3-0.6B: 28 layers, 8 KV heads of 128; bf16, 2048 positions:
    # 2 x 28 x 8 x 2048 x 128 x 2 bytes = 224 MiB a slot
    from asyncrl.inference.server.model import ModelConfig

    qwen3 = ModelConfig.from_hf({
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True})
    assert memory.kv_slot_bytes(qwen3, torch.bfloat16, 2048) == 234_881_024 == 224 * 2**20
    assert memory.kv_slot_bytes(qwen3, torch.float32, 1024) == 224 * 2**20


def test_the_budget_is_the_share_less_the_weights_twice_and_a_step():
    assert memory.kv_budget(0.5, 1000, 100, 50) == 250
    assert memory.kv_budget(0.1, 1000, 100, 50) == -150  # nothing left
    assert memory.kv_slots(250, 60, 8) == 4  # whole slots
    assert memory.kv_slots(10**9, 60, 8) == 8  # never more than max_batch_size
    with pytest.raises(ValueError, match=r"leaves 0.0 KiB for the KV cache, but one slot .* "
                                         r"raise rollout.gpu_memory_fraction or lower "
                                         r"local_engine.max_seq_len"):
        memory.kv_slots(-150, 60, 8)


def test_the_activation_reserve_of_the_tiny_model_by_hand(tiny_path):
    cfg, _ = load_config(tiny_path)
    # tiny: hidden 64, intermediate 128, 2 heads and 1 KV head of 32. N = 8192 rows:
    # per row 4 x 64 + 2 x (2 + 2) x 32 + 3 x 128 = 896 elements; scores 2 x 8192 x 256;
    # sampling 4 copies of 8 x vocab float32 logits.
    expected = (8192 * 896 + 2 * 8192 * 256) * 2 + 4 * 8 * cfg.vocab_size * 4
    assert memory.activation_reserve(cfg, torch.bfloat16, 8, 256) == expected


def test_a_cache_budget_gives_the_slots_that_fit_and_the_engine_still_serves_more(tiny_path):
    cfg = LocalEngineConfig(dtype="bfloat16", max_batch_size=8, max_seq_len=256)
    # tiny: a slot is 2 (k, v) x 2 layers x 1 KV head x 256 x 32 x 2 bytes = 64 KiB
    engine = LocalEngine(tiny_path, cfg, kv_budget_bytes=200_000)
    assert engine.config.max_batch_size == 3
    assert tuple(engine.cache.k.shape) == (2, 3, 1, 256, 32)
    cache_bytes = 2 * engine.cache.k.numel() * engine.cache.k.element_size()
    assert cache_bytes == 3 * 65_536 <= 200_000
    done = []
    params = SamplingParams(temperature=1.0, max_new_tokens=5, ignore_eos=True)
    for i in range(5):  # more requests than slots: they wait for one
        engine.submit(GenerationRequest(input_ids=[1, 60 + i, 61], sampling=params), done.append)
    most = 0
    while len(done) < 5:
        engine.step()
        most = max(most, engine.stats()["running"])
    assert most == 3 and all(len(r.output_ids) == 5 for r in done)


def test_a_budget_below_one_slot_names_the_keys(tiny_path):
    cfg = LocalEngineConfig(dtype="bfloat16", max_batch_size=8, max_seq_len=256)
    with pytest.raises(ValueError, match="kv_budget_bytes=60000 leaves 58.6 KiB for the KV "
                                         "cache, but one slot of local_engine.max_seq_len "
                                         "positions needs 64.0 KiB"):
        LocalEngine(tiny_path, cfg, kv_budget_bytes=60_000)


def test_a_memory_fraction_is_for_cuda_engines(tiny_path):
    with pytest.raises(ValueError, match="gpu_memory_fraction=0.5 is for a CUDA device, not "
                                         "'cpu'"):
        LocalEngine(tiny_path, LocalEngineConfig(), gpu_memory_fraction=0.5)
    assert parse_args(["--model", "m", "--gpu-memory-fraction", "0.3"]).gpu_memory_fraction == 0.3
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--gpu-memory-fraction", "1.5"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA engine's share of its GPU")
def test_a_cuda_engine_sizes_its_cache_from_its_share_of_the_gpu(tiny_path):
    import math

    from asyncrl.inference.server.model import hf_shapes

    cfg, _ = load_config(tiny_path)
    total = torch.cuda.get_device_properties(0).total_memory
    weights = sum(math.prod(s) for s in hf_shapes(cfg).values()) * 2  # bf16, tied
    reserve = memory.activation_reserve(cfg, torch.bfloat16, 64, 2048)
    slot = memory.kv_slot_bytes(cfg, torch.bfloat16, 2048)
    fraction = (2 * weights + reserve + 10.5 * slot) / total  # room for 10 slots
    try:
        engine = LocalEngine(tiny_path, LocalEngineConfig(max_batch_size=64, max_seq_len=2048),
                             device="cuda", gpu_memory_fraction=fraction)
        assert engine.config.max_batch_size == engine.cache.k.shape[1] == 10
        done = []
        engine.submit(GenerationRequest(input_ids=[1, 2, 3], sampling=SamplingParams(
            max_new_tokens=4, ignore_eos=True)), done.append)
        while not done:
            engine.step()
        assert len(done[0].output_ids) == 4
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def test_a_gpu_share_caps_the_allocator_on_an_indexed_device(tiny_path, monkeypatch):
    """torch wants a device index for the cap: "cuda" is the current device (found on a GPU:
    torch.device("cuda") was refused)."""
    from torch._utils import _get_device_index

    from asyncrl.inference.server import engine as engine_module

    caps = []

    def cap(fraction, device):
        caps.append((fraction, _get_device_index(device)))  # torch's own check of the device

    class Loaded(Exception):
        pass

    def stop(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", cap)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(engine_module.Transformer, "from_pretrained", stop)
    for device, index in (("cuda", 2), ("cuda:1", 1)):
        with pytest.raises(Loaded):
            LocalEngine(tiny_path, LocalEngineConfig(), device=device, gpu_memory_fraction=0.4)
        assert caps[-1] == (0.4, index)
