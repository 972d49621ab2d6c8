"""Qwen3-MoE in the local engine: HF parity of the forward and of generation log-probs, the
config's routing options, and the experts each token was routed to."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from asyncrl.api.types import GenerationRequest, GenerationResponse, SamplingParams
from asyncrl.config.schema import LocalEngineConfig
from asyncrl.inference.server.engine import LocalEngine
from asyncrl.inference.server.model import (
    CheckpointError,
    ModelConfig,
    Transformer,
    load_config,
    read_checkpoint,
)
from asyncrl.models.tiny import make_tiny_model

torch.set_num_threads(1)
FP32_TOL = 1e-4  # as the dense models' parity tests (test_local_engine.py)


def hf_model(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_forward(path: str, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's logits [T, V] and the experts its routers chose [T, MoE layers, top_k]."""
    model = hf_model(path)
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    chosen = [logits.softmax(-1).topk(k, dim=-1).indices for logits in out.router_logits]
    return out.logits[0], torch.stack(chosen, dim=1)


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("moe") / "m", arch="qwen3_moe")


@pytest.mark.parametrize("moe, sparse", [
    ({}, (0, 1)),
    ({"norm_topk_prob": True, "mlp_only_layers": [0]}, (1,)),
    ({"decoder_sparse_step": 2, "num_experts_per_tok": 3}, (1,)),
], ids=["all-sparse", "normalised-dense-first", "every-second"])
def test_moe_forward_matches_hf_in_fp32(tmp_path, moe, sparse):
    path = make_tiny_model(tmp_path / "m", arch="qwen3_moe", moe=moe)
    model = Transformer.from_pretrained(path, dtype=torch.float32, max_seq_len=64)
    assert model.cfg.moe_layers == sparse  # HF's rule, worked out by hand for 2 layers
    cache = model.new_cache(max_batch_size=2, max_seq_len=64)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (9, 4)]
    tokens = torch.zeros(2, 9, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = torch.tensor(s)
    logits = model.prefill(tokens, torch.tensor([9, 4]), cache, slot_start=0, all_logits=True)
    prefill_routes = model.last_routes
    for i, s in enumerate(seqs):
        ref, chosen = hf_forward(path, s)
        torch.testing.assert_close(logits[i, :len(s)], ref, atol=FP32_TOL, rtol=0)
        assert torch.equal(prefill_routes[i, :len(s)].long(), chosen)
    positions = torch.tensor([9, 4])
    for _ in range(2):
        new = torch.randint(3, 250, (2,), generator=gen)
        logits = model.decode(new, positions, cache, kv_len=int(positions.max()) + 1)
        for i, s in enumerate(seqs):
            s.append(int(new[i]))
            ref, chosen = hf_forward(path, s)
            torch.testing.assert_close(logits[i], ref[-1], atol=FP32_TOL, rtol=0)
            assert torch.equal(model.last_routes[i].long(), chosen[-1])
        positions += 1


def test_norm_topk_prob_changes_the_output(moe_path):
    """The flag reaches the forward: the same weights give other logits with it flipped."""
    model = Transformer.from_pretrained(moe_path, dtype=torch.float32, max_seq_len=16)
    flipped = Transformer(ModelConfig(**{**vars(model.cfg), "norm_topk_prob": True}),
                          dtype=torch.float32, max_seq_len=16)
    flipped.w = model.w
    tokens, lengths = torch.tensor([[5, 9, 40, 7]]), torch.tensor([4])
    plain = model.prefill(tokens, lengths, model.new_cache(1, 16), 0)
    normed = flipped.prefill(tokens, lengths, flipped.new_cache(1, 16), 0)
    assert (plain - normed).abs().max() > 1e-2


def test_stacked_expert_tensors_load_like_per_expert_ones(moe_path, tmp_path):
    """transformers' in-memory names (experts.gate_up_proj [E, 2I, H], experts.down_proj),
    what the trainer publishes, give the same weights as the checkpoint's per-expert names."""
    cfg, _ = load_config(moe_path)
    tensors = load_file(f"{moe_path}/model.safetensors")
    stacked = {}
    for name, t in tensors.items():
        if ".experts." not in name:
            stacked[name] = t
    for n in cfg.moe_layers:
        m = f"model.layers.{n}.mlp.experts"
        stacked[f"{m}.gate_up_proj"] = torch.stack([torch.cat(
            [tensors[f"{m}.{e}.gate_proj.weight"], tensors[f"{m}.{e}.up_proj.weight"]])
            for e in range(cfg.num_experts)])
        stacked[f"{m}.down_proj"] = torch.stack(
            [tensors[f"{m}.{e}.down_proj.weight"] for e in range(cfg.num_experts)])
    folder = tmp_path / "stacked"
    folder.mkdir()
    save_file(stacked, str(folder / "model.safetensors"))
    shutil.copy(f"{moe_path}/config.json", folder / "config.json")
    model = Transformer.from_pretrained(moe_path, dtype=torch.float32)
    assert model.read_weights(str(folder)).digest() == model.w.digest()
    del stacked[f"model.layers.{cfg.moe_layers[0]}.mlp.experts.down_proj"]
    save_file(stacked, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensors .*experts\.0\.down_proj"):
        read_checkpoint(str(folder), model.w._shapes)


def test_bad_moe_config_keys_are_named(moe_path):
    raw = json.loads(Path(moe_path, "config.json").read_text())
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        ModelConfig.from_hf({**raw, "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match="decoder_sparse_step=0"):
        ModelConfig.from_hf({**raw, "decoder_sparse_step": 0})


def new_engine(path: str, **kw) -> LocalEngine:
    cfg = {"dtype": "float32", "max_batch_size": 4, "max_seq_len": 64}
    return LocalEngine(path, LocalEngineConfig(**{**cfg, **kw}), seed=0)


def run_all(engine: LocalEngine, reqs: list[GenerationRequest]) -> dict[str, GenerationResponse]:
    out: dict = {}
    for r in reqs:
        engine.submit(r, lambda resp, rid=r.rid: out.__setitem__(rid, resp))
    while len(out) < len(reqs):
        engine.step()
    return out


def test_generation_logprobs_and_routes_match_hf(moe_path):
    """Sampled completions of prompts of two lengths, batched: each token's log-prob is HF's
    (fp32), and the recorded experts of prompt and completion tokens are HF's top-k; the
    last token, never run, holds -1."""
    params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True)
    reqs = [GenerationRequest(input_ids=[7, 30, 41, 9, 12, 80, 5], sampling=params),
            GenerationRequest(input_ids=[100, 3, 56], sampling=params)]
    out = run_all(new_engine(moe_path), reqs)
    for r in reqs:
        resp = out[r.rid]
        ids = r.input_ids + resp.output_ids
        logits, chosen = hf_forward(moe_path, ids)
        ref = logits[len(r.input_ids) - 1:-1].log_softmax(-1)
        ref = ref.gather(-1, torch.tensor(resp.output_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(resp.output_logprobs), ref, atol=FP32_TOL,
                                   rtol=0)
        routes = resp.routed_experts
        assert routes.dtype == torch.int16 and routes.shape == (len(ids), 2, 2)
        assert torch.equal(routes[:-1].long(), chosen[:-1])
        assert (routes[-1] == -1).all()
        # the HTTP form carries them unchanged
        again = GenerationResponse.from_dict(json.loads(json.dumps(resp.to_dict())))
        assert torch.equal(again.routed_experts, routes)


def test_recomputed_cache_records_the_new_weights_routes(moe_path, tmp_path):
    """A weight update with recompute_kv_on_update routes the cached tokens again: the
    recorded experts are then those of the new weights for every token run before."""
    v1 = make_tiny_model(tmp_path / "v1", arch="qwen3_moe", seed=1)
    engine = new_engine(moe_path, recompute_kv_on_update=True)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)
    req = GenerationRequest(input_ids=[7, 30, 41, 9, 12], sampling=params)
    out: dict = {}
    engine.submit(req, lambda resp: out.__setitem__(req.rid, resp))
    for _ in range(4):
        engine.step()
    engine.update_weights(v1, 1)
    while not out:
        engine.step()
    resp = out[req.rid]
    _, chosen_v1 = hf_forward(v1, req.input_ids + resp.output_ids)
    assert torch.equal(resp.routed_experts[:-1].long(), chosen_v1[:-1])
    _, chosen_v0 = hf_forward(moe_path, req.input_ids + resp.output_ids)
    assert not torch.equal(chosen_v0[:-1], chosen_v1[:-1])  # the test can tell them apart


def test_bfloat16_generation_runs_on_the_plain_path_and_records_routes(moe_path):
    """bf16 on the CPU: MoE layers run outside the C forward (oneDNN or plain matmuls); the
    log-probs stay within 0.05 of HF's fp32 values (0.013 here)."""
    engine = new_engine(moe_path, dtype="bfloat16")
    assert not engine.model.fused
    params = SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True)
    req = GenerationRequest(input_ids=[7, 30, 41, 9, 12], sampling=params)
    resp = run_all(engine, [req])[req.rid]
    logits, _ = hf_forward(moe_path, req.input_ids + resp.output_ids)
    ref = logits[len(req.input_ids) - 1:-1].log_softmax(-1)
    ref = ref.gather(-1, torch.tensor(resp.output_ids)[:, None])[:, 0]
    assert resp.routed_experts.shape == (9, 2, 2)
    torch.testing.assert_close(torch.tensor(resp.output_logprobs), ref, atol=0.05, rtol=0)
