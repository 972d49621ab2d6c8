"""The local engine: forward parity with HF, continuous batching, interruptible weight updates."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from asyncrl.api.types import GenerationRequest, SamplingParams, StopReason
from asyncrl.config.schema import LocalEngineConfig
from asyncrl.inference.server.engine import LocalEngine, _shared_prefixes
from asyncrl.inference.server.model import (
    CheckpointError,
    ModelConfig,
    PackedMatrix,
    Transformer,
    Weights,
    can_pack,
    hf_shapes,
    load_config,
    read_checkpoint,
    rope_inv_freq,
)
from asyncrl.models import safetensors_file
from asyncrl.models.tiny import make_tiny_model

torch.set_num_threads(1)
FP32_TOL = 1e-4  # our fp32 forward vs HF's: same maths, different op order


def hf_model(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logprobs(path: str, prompt: list[int], output: list[int],
                temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) of each output token, from one HF forward over the full sequence."""
    ids = prompt + output
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([ids])).logits[0, len(prompt) - 1:-1]
    return (logits / temperature).log_softmax(-1).gather(-1, torch.tensor(output)[:, None])[:, 0]


def assert_forward_matches_hf(path: str) -> None:
    """Padded batched prefill, then three batched decode steps, against HF full forwards."""
    hf = hf_model(path)
    model = Transformer.from_pretrained(path, dtype=torch.float32, max_seq_len=64)
    cache = model.new_cache(max_batch_size=3, max_seq_len=64)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([11, 6, 3])
    tokens = torch.randint(3, 300, (3, 11), generator=gen)
    seqs = [tokens[i, :n].tolist() for i, n in enumerate(lengths)]
    logits = model.prefill(tokens, lengths, cache, slot_start=0, all_logits=True)
    with torch.no_grad():
        for i, s in enumerate(seqs):
            torch.testing.assert_close(logits[i, :len(s)], hf(torch.tensor([s])).logits[0],
                                       atol=FP32_TOL, rtol=0)
        positions = lengths.clone()
        for _ in range(3):
            new = torch.randint(3, 300, (3,), generator=gen)
            logits = model.decode(new, positions, cache, kv_len=int(positions.max()) + 1)
            for i, s in enumerate(seqs):
                s.append(int(new[i]))
                torch.testing.assert_close(logits[i], hf(torch.tensor([s])).logits[0, -1],
                                           atol=FP32_TOL, rtol=0)
            positions += 1


# ---- the forward ---------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_forward_matches_hf_logits_in_fp32(tmp_path, arch):
    assert_forward_matches_hf(make_tiny_model(tmp_path / arch, arch=arch))


def test_untied_lm_head_matches_hf(tmp_path):
    assert_forward_matches_hf(make_tiny_model(tmp_path / "m", tie_word_embeddings=False))


def _edit_config(path: str, **changes) -> None:
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)


def test_llama3_rope_scaling_matches_hf(tmp_path):
    path = make_tiny_model(tmp_path / "m")
    _edit_config(path, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    cfg, _ = load_config(path)
    plain = ModelConfig(**{**cfg.__dict__, "rope": {"rope_type": "default"}})
    # With a 64-token original context, the lowest frequencies of head_dim 32 are rescaled.
    assert not torch.allclose(rope_inv_freq(cfg), rope_inv_freq(plain))
    assert_forward_matches_hf(path)


def test_unsupported_rope_type_and_model_type_are_named(tmp_path):
    path = make_tiny_model(tmp_path / "m")
    _edit_config(path, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(NotImplementedError, match="rope type 'yarn'"):
        Transformer.from_pretrained(path)
    _edit_config(path, model_type="gpt2", rope_parameters={"rope_type": "default"})
    with pytest.raises(NotImplementedError, match="model_type 'gpt2'"):
        Transformer.from_pretrained(path)


def test_bfloat16_prefill_matches_hf_bfloat16(tmp_path):
    path = make_tiny_model(tmp_path / "m")
    tokens = torch.randint(3, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref = hf(tokens).logits[0].float()
    model = Transformer.from_pretrained(path, dtype=torch.bfloat16, max_seq_len=32)
    model.kernels = None  # the torch path
    model.w = model.read_weights(path)
    cache = model.new_cache(1, 32)
    ours = model.prefill(tokens, torch.tensor([16]), cache, 0, all_logits=True)[0].float()
    # Same kernels and op order as HF's bf16 forward: equal up to one bf16 rounding of
    # logits of magnitude ~5 (2^-8 * 8 = 0.03).
    torch.testing.assert_close(ours, ref, atol=0.04, rtol=0)


@pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")),
                    reason="no oneDNN in this torch build")
def test_prepacked_weights_give_the_same_logits_as_plain(tmp_path):
    path = make_tiny_model(tmp_path / "m")
    model = Transformer.from_pretrained(path, dtype=torch.bfloat16, max_seq_len=32)
    tokens = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([9, 5])
    valid = torch.arange(9)[None, :] < lengths[:, None]
    tensors = read_checkpoint(path, hf_shapes(model.cfg))
    packs = ["onednn", None] + (["asyncrl"] if model.pack_mode() == "asyncrl" else [])
    out = []
    for pack in packs:
        model.w = Weights(model.cfg, tensors, torch.bfloat16, pack=pack)
        wqkv = model.w.layers[0].wqkv
        assert isinstance(wqkv, PackedMatrix) == (pack == "asyncrl")
        assert pack == "asyncrl" or wqkv.is_mkldnn == (pack == "onednn")
        logits = model.prefill(tokens, lengths, model.new_cache(2, 32), 0, all_logits=True)
        out.append(logits.float()[valid])  # padded positions are unspecified
    torch.testing.assert_close(out[1], out[0], atol=0.04, rtol=0)  # oneDNN vs plain torch
    for other in out[2:]:
        # our kernels: float32 attention and another summation order, as in decode
        torch.testing.assert_close(other, out[0], atol=0.125, rtol=0)


# ---- continuous batching ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "v0", seed=0)


@pytest.fixture(scope="module")
def tiny_v1(tmp_path_factory) -> str:
    """Same shapes, different weights: the 'trained' version 1."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "v1", seed=1)


def new_engine(path: str, **kw) -> LocalEngine:
    cfg = dict(dtype="float32", max_batch_size=4, max_seq_len=128)
    return LocalEngine(path, LocalEngineConfig(**{**cfg, **kw}), seed=0)


def submit(engine: LocalEngine, req: GenerationRequest, out: dict) -> None:
    engine.submit(req, lambda resp: out.__setitem__(req.rid, resp))


def drain(engine: LocalEngine, out: dict, n: int) -> None:
    while len(out) < n:
        engine.step()


def greedy(ids: list[int], n: int) -> GenerationRequest:
    params = SamplingParams(temperature=0.0, max_new_tokens=n)
    return GenerationRequest(input_ids=ids, sampling=params)


def alone(path: str, req: GenerationRequest, **kw):
    out: dict = {}
    engine = new_engine(path, **kw)
    submit(engine, req, out)
    drain(engine, out, 1)
    return out[req.rid]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_request_admitted_mid_decode_matches_running_alone(tiny, dtype):
    # bf16 on CPU: the C forward prefills b in the same pass as a's next token; every row's
    # maths is independent of the others', so even the log-probs are bit-identical
    a, b = greedy([10, 11, 12, 13], 30), greedy([200, 150, 100, 50, 25, 12, 6], 20)
    engine, out = new_engine(tiny, dtype=dtype), {}
    submit(engine, a, out)
    for _ in range(6):
        engine.step()
    assert len(out) == 0 and engine.stats()["running"] == 1
    submit(engine, b, out)
    drain(engine, out, 2)
    for req in (a, b):
        single = alone(tiny, req, dtype=dtype)
        assert out[req.rid].output_ids == single.output_ids
        if dtype == "bfloat16" and engine.model.fused:
            assert out[req.rid].output_logprobs == single.output_logprobs


def test_shared_prefixes_pick_the_longest_earlier_full_prompt_and_keep_the_last_token():
    a = list(range(10, 30))  # 20 tokens
    prompts = [a, a, a[:12] + [1, 2, 3], [5] * 9, a[:5] + [7] * 10, a + [99]]
    donor, shared = _shared_prefixes(prompts, min_shared=8)
    # identical: all but the last token; partial: the common 12; short overlap (5): none;
    # a + [99] shares all of a with prompt 0 (prompts 1 and 2 are not full, so not donors)
    assert donor == [-1, 0, 0, -1, -1, 0]
    assert shared == [0, 19, 12, 0, 0, 20]
    assert _shared_prefixes([a], 8) == ([-1], [0])


def test_a_group_of_equal_prompts_computes_the_prompt_once_and_matches_running_alone(tiny):
    engine = new_engine(tiny, dtype="bfloat16", max_batch_size=8)
    if not engine.model.fused:
        pytest.skip("needs the C forward (AVX512-BF16)")
    prompt = list(range(40, 70))  # 30 tokens
    reqs = [greedy(prompt, 6) for _ in range(4)] + [greedy(prompt[:20] + [5, 6, 7], 6)]
    rows = []
    forward = engine.model.forward_rows
    engine.model.forward_rows = lambda tokens, *a: rows.append(len(tokens)) or forward(tokens, *a)
    out: dict = {}
    for r in reqs:
        submit(engine, r, out)
    drain(engine, out, len(reqs))
    # the first step: prompt 0 in full (30 rows), then the last token of each copy (3 rows)
    # and the 3 tokens after the shared 20 of the last prompt
    assert rows[:2] == [30, 3 + 3]
    for r in reqs:
        single = alone(tiny, r, dtype="bfloat16")
        assert out[r.rid].output_ids == single.output_ids
        assert out[r.rid].output_logprobs == single.output_logprobs


def test_shared_prefixes_can_come_from_running_sequences():
    running = [list(range(100, 130)), []]  # a running sequence's cached tokens; a stale one
    a = list(range(100, 125)) + [1, 2]
    donor, shared = _shared_prefixes([a, a, [3] * 12], 8, running)
    # the first takes 25 tokens from slot 0 and is computed past them, so it is a source:
    # the second takes all but its last token from it (index 2 = slot 2)
    assert donor == [0, 2, -1] and shared == [25, 26, 0]


def test_a_request_admitted_mid_decode_reuses_a_running_prompt_bit_for_bit(tiny):
    engine = new_engine(tiny, dtype="bfloat16")
    if not engine.model.fused:
        pytest.skip("needs the C forward (AVX512-BF16)")
    prompt = list(range(40, 70))
    first, second = greedy(prompt, 12), greedy(prompt + [7, 8], 6)
    rows = []
    forward = engine.model.forward_rows
    engine.model.forward_rows = lambda tokens, *a: rows.append(len(tokens)) or forward(tokens, *a)
    out: dict = {}
    submit(engine, first, out)
    for _ in range(3):
        engine.step()
    submit(engine, second, out)
    engine.step()
    # 1 decode row + the 2 tokens after the 30 shared with the running request
    assert rows[3] == 1 + 2
    drain(engine, out, 2)
    for r in (first, second):
        single = alone(tiny, r, dtype="bfloat16")
        assert out[r.rid].output_ids == single.output_ids
        assert out[r.rid].output_logprobs == single.output_logprobs


def test_running_caches_from_old_weights_are_not_shared(tiny, tiny_v1):
    engine = new_engine(tiny, dtype="bfloat16", recompute_kv_on_update=False)
    if not engine.model.fused:
        pytest.skip("needs the C forward (AVX512-BF16)")
    prompt = list(range(40, 70))
    out: dict = {}
    submit(engine, greedy(prompt, 20), out)
    for _ in range(3):
        engine.step()
    engine.update_weights(tiny_v1, 1)  # the running request keeps its version-0 cache
    rows = []
    forward = engine.model.forward_rows
    engine.model.forward_rows = lambda tokens, *a: rows.append(len(tokens)) or forward(tokens, *a)
    second = greedy(prompt + [7, 8], 4)
    submit(engine, second, out)
    engine.step()
    assert rows == [1 + 32]  # the new prompt computed in full, under version 1
    drain(engine, out, 2)
    assert out[second.rid].output_logprobs == alone(tiny_v1, second,
                                                    dtype="bfloat16").output_logprobs


def test_kv_recompute_after_an_update_shares_a_groups_prompt_bit_for_bit(tiny, tiny_v1,
                                                                        monkeypatch):
    prompt = list(range(40, 70))
    runs = []
    for min_shared in (8, 10**9):  # shared prefixes, then none
        monkeypatch.setattr("asyncrl.inference.server.engine.MIN_SHARED_PREFIX", min_shared)
        engine = new_engine(tiny, dtype="bfloat16", max_batch_size=8)
        if not engine.model.fused:
            pytest.skip("needs the C forward (AVX512-BF16)")
        reqs = [greedy(prompt, 10) for _ in range(4)]
        out: dict = {}
        for r in reqs:
            submit(engine, r, out)
        for _ in range(4):
            engine.step()
        rows = []
        forward = engine.model.forward_rows
        engine.model.forward_rows = (
            lambda tokens, *a, f=forward, seen=rows: seen.append(len(tokens)) or f(tokens, *a))
        engine.update_weights(tiny_v1, 1)  # recomputes the cache of all 4 under version 1
        recompute = list(rows)
        drain(engine, out, 4)
        runs.append(([out[r.rid].output_ids for r in reqs],
                     [out[r.rid].output_logprobs for r in reqs], recompute))
    # each sequence has 33 cached tokens (30 prompt + 3 generated, all alike: greedy)
    assert runs[0][2] == [33, 3] and runs[1][2] == [4 * 33]
    assert runs[0][0] == runs[1][0] and runs[0][1] == runs[1][1]


def test_waiting_requests_fill_freed_slots_and_match_running_alone(tiny):
    # 6 requests, 2 slots: finishing requests free slots mid-decode (the last active
    # sequence moves into the freed slot) and queued ones are admitted.
    reqs = [greedy([20 + i, 30 + 2 * i, 40 + 3 * i][: 1 + i % 3], 5 + 4 * i) for i in range(6)]
    engine, out = new_engine(tiny, max_batch_size=2), {}
    for r in reqs:
        submit(engine, r, out)
    engine.step()
    assert engine.stats() == {"version": 0, "running": 2, "waiting": 4, "paused": False}
    drain(engine, out, len(reqs))
    for r in reqs:
        assert out[r.rid].output_ids == alone(tiny, r).output_ids


def test_full_slot_stops_with_length(tiny):
    engine, out = new_engine(tiny, max_seq_len=32), {}
    req = greedy(list(range(5, 25)), 100)
    submit(engine, req, out)
    drain(engine, out, 1)
    assert len(out[req.rid].output_ids) == 32 - 20
    assert out[req.rid].stop_reason == StopReason.LENGTH
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.submit(greedy(list(range(3, 40)), 5), print)


# ---- weight updates ---------------------------------------------------------------------------

PROMPT = [60, 61, 62, 63, 64, 65]


def generate_across_update(path: str, new_path: str, recompute: bool, steps_before: int):
    engine, out = new_engine(path, recompute_kv_on_update=recompute), {}
    params = SamplingParams(temperature=0.8, max_new_tokens=24)
    req = GenerationRequest(input_ids=PROMPT, sampling=params)
    submit(engine, req, out)
    for _ in range(steps_before):
        engine.step()
    engine.update_weights(new_path, version=1)
    drain(engine, out, 1)
    return out[req.rid]


def test_update_mid_generation_gives_two_versions_and_new_policy_logprobs(tiny, tiny_v1):
    # Step 1 admits (first token) and decodes once; each later step adds one token.
    resp = generate_across_update(tiny, tiny_v1, recompute=True, steps_before=4)
    assert resp.output_versions == [0] * 5 + [1] * 19
    lp = torch.tensor(resp.output_logprobs)
    torch.testing.assert_close(lp[:5], hf_logprobs(tiny, PROMPT, resp.output_ids, 0.8)[:5],
                               atol=FP32_TOL, rtol=0)
    # Recomputed KV: every later token is exactly the new policy's, over the full sequence.
    torch.testing.assert_close(lp[5:], hf_logprobs(tiny_v1, PROMPT, resp.output_ids, 0.8)[5:],
                               atol=FP32_TOL, rtol=0)


def test_update_without_kv_recompute_keeps_stale_cache(tiny, tiny_v1):
    resp = generate_across_update(tiny, tiny_v1, recompute=False, steps_before=4)
    assert resp.output_versions == [0] * 5 + [1] * 19
    new_policy = hf_logprobs(tiny_v1, PROMPT, resp.output_ids, 0.8)[5:]
    # Keys and values of the first 10 tokens still come from version 0.
    assert (torch.tensor(resp.output_logprobs[5:]) - new_policy).abs().max() > 1e-2


def test_an_update_copies_the_files_weights_so_a_later_write_in_place_changes_nothing(
        tiny, tiny_v1, tmp_path):
    # The update reads the file through a mapping; the publisher later writes the next
    # version into the same file. What the engine serves must be its own copy.
    folder = tmp_path / "v1"
    shutil.copytree(tiny_v1, folder)
    file = folder / "model.safetensors"
    # in our writer's layout (load_file's tensors may map the file: copies)
    safetensors_file.write(file, {k: v.clone() for k, v in load_file(file).items()})
    engine = new_engine(tiny)
    engine.update_weights(str(folder), version=1)
    served = engine.weights_digest()
    assert served == new_engine(tiny_v1).weights_digest() | {"version": 1}
    assert safetensors_file.write(file, load_file(Path(tiny) / "model.safetensors")) is True
    assert engine.weights_digest() == served
    out: dict = {}
    req = greedy(PROMPT, 12)
    submit(engine, req, out)
    drain(engine, out, 1)
    assert out[req.rid].output_ids == alone(tiny_v1, greedy(PROMPT, 12)).output_ids


def test_failed_updates_keep_old_weights_and_version(tiny, tmp_path):
    engine = new_engine(tiny)
    before = alone(tiny, greedy(PROMPT, 12)).output_ids
    missing = tmp_path / "missing"
    shutil.copytree(tiny, missing)
    tensors = load_file(missing / "model.safetensors")
    kept = {k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k}
    save_file(kept, missing / "model.safetensors")
    wider = make_tiny_model(tmp_path / "wider", intermediate_size=192)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "model.safetensors").write_bytes(b"half-written" * 10)
    for path, message in [(tmp_path / "nope", "not a folder"), (tmp_path, "no \\*.safetensors"),
                          (corrupt, "cannot read"),
                          (missing, "missing tensors.*up_proj"),
                          (wider, "mis-shaped tensors.*gate_proj")]:
        with pytest.raises(CheckpointError, match=message):
            engine.update_weights(str(path), version=7)
    assert engine.version == 0
    out: dict = {}
    req = greedy(PROMPT, 12)
    submit(engine, req, out)
    drain(engine, out, 1)
    assert out[req.rid].output_ids == before


# ---- the engine thread ------------------------------------------------------------------------

def test_pause_holds_requests_and_resume_finishes_them(tiny):
    engine = new_engine(tiny)
    engine.start()
    try:
        engine.pause()
        done = threading.Event()
        engine.submit(greedy(PROMPT, 8), lambda resp: done.set())
        assert not done.wait(0.3)
        assert engine.stats() == {"version": 0, "running": 0, "waiting": 1, "paused": True}
        engine.resume()
        assert done.wait(10)
    finally:
        engine.close()


def test_threaded_update_does_not_wait_for_generation_in_flight(tiny, tiny_v1):
    engine = new_engine(tiny, max_seq_len=2048)
    engine.start()
    try:
        result: dict = {}
        finished = threading.Event()
        req = greedy(PROMPT, 1500)
        engine.submit(req, lambda resp: (result.update(resp=resp), finished.set()))
        deadline = time.monotonic() + 10
        while engine.stats()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        engine.update_weights(tiny_v1, version=1)
        assert not finished.is_set()  # the update landed while the generation was running
        assert finished.wait(60)
    finally:
        engine.close()
    versions = result["resp"].output_versions
    first_new = versions.index(1)
    assert 0 < first_new and versions == [0] * first_new + [1] * (len(versions) - first_new)
    assert result["resp"].stop_reason == StopReason.LENGTH


def test_huge_zeros_reads_zero_writes_through_and_outlives_its_first_view():
    import gc

    from asyncrl.inference.server.cpu_decode import huge_zeros

    shape = (3, 4, 5, 1 << 16)  # 7.5 MB of bf16: on 2 MB pages
    cache = huge_zeros(shape, torch.bfloat16)
    assert cache.shape == shape and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    assert cache.data_ptr() % (2 << 20) == 0
    assert torch.count_nonzero(cache) == 0
    cache[1, 2].fill_(1.5)
    layer = cache[1]
    del cache
    gc.collect()  # the memory map lives as long as any view of it
    assert layer[2].float().mean() == 1.5 and torch.count_nonzero(layer) == 5 * (1 << 16)
    small = huge_zeros((4, 8), torch.float32)  # under a page: plain torch.zeros
    assert torch.equal(small, torch.zeros(4, 8))


def seeded(ids: list[int], n: int, seed: int) -> GenerationRequest:
    return GenerationRequest(input_ids=ids, sampling=SamplingParams(temperature=1.0,
                                                                    max_new_tokens=n, seed=seed))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: the C sampler
def test_a_seeded_request_samples_the_same_tokens_whatever_it_is_batched_with(tiny, dtype):
    a = seeded([10, 11, 12, 13], 24, seed=7)
    single = alone(tiny, a, dtype=dtype)
    # the same request admitted mid-decode among unseeded and other seeded ones (a different
    # slot, different neighbours, an engine whose shared stream is elsewhere)
    engine, out = new_engine(tiny, dtype=dtype), {}
    others = [GenerationRequest(input_ids=[50 + i, 60], sampling=SamplingParams(
        temperature=1.0, max_new_tokens=30)) for i in range(2)] + [seeded([99, 98], 30, seed=8)]
    for r in others:
        submit(engine, r, out)
    for _ in range(3):
        engine.step()
    again = GenerationRequest(input_ids=a.input_ids, sampling=a.sampling)  # a new rid
    submit(engine, again, out)
    drain(engine, out, 4)
    assert out[again.rid].output_ids == single.output_ids
    tol = FP32_TOL if dtype == "float32" else 2e-2
    assert out[again.rid].output_logprobs == pytest.approx(single.output_logprobs, abs=tol)
    # another seed, another answer (24 tokens from a random model at T = 1)
    assert alone(tiny, seeded(a.input_ids, 24, seed=8), dtype=dtype).output_ids \
        != single.output_ids
