"""Shared-prefix training: the token trie, and its forward/backward against the padded path.

Every comparison is fp32 on a tiny random model. The trie runs other matrix shapes than the
padded batch (other sums in other orders), so the numbers agree to rounding, not bitwise.
"""

import dataclasses

import pytest
import torch

from asyncrl.api.types import TensorBatch
from asyncrl.config.engine import TrainEngineSpec
from asyncrl.config.offline import TrainEngineConfig
from asyncrl.config.schema import MicroBatchSpec, OptimizerConfig
from asyncrl.trainer import FSDPTrainEngine, FSDPValueEngine
from asyncrl.trainer import engine as engine_module
from asyncrl.trainer.cpu import logprob_head
from asyncrl.trainer.cpu.attention import use_trie_attention
from asyncrl.trainer.prefix import pack_prefixes

pytestmark = pytest.mark.usefixtures("process_group")

# Observed: log-probs (magnitude ~6) differ by <= 2e-6; each parameter's gradient by
# <= 1.3e-6 of its largest entry (elementwise relative errors of near-zero entries say
# nothing). A few times that leaves room for other thread counts without hiding a real
# error: a wrong mask or position moves log-probs by ~1e-1.
LOGPROB_TOL = {"atol": 1e-5, "rtol": 1e-5}
GRAD_TOL = 1e-5  # of the gradient's largest entry


def nll_loss(logprobs, mb, *, n_tokens, n_seqs):
    """Token-level negative log-likelihood over the whole batch's loss tokens."""
    loss = -(logprobs * mb.loss_mask).sum() / n_tokens
    worst = float(-logprobs.detach()[mb.loss_mask > 0].min())
    return loss, {"nll_tokens": float(mb.loss_mask.sum()), "nll_max": worst}


def rows_to_batch(rows: list[tuple[list[int], int]]) -> TensorBatch:
    """Right-padded rows of (tokens, prompt length); the tokens after the prompt are loss tokens."""
    n, width = len(rows), max(len(tokens) for tokens, _ in rows)
    input_ids = torch.zeros(n, width, dtype=torch.long)
    loss_mask = torch.zeros(n, width)
    for i, (tokens, prompt_len) in enumerate(rows):
        input_ids[i, :len(tokens)] = torch.tensor(tokens)
        loss_mask[i, prompt_len:len(tokens)] = 1.0
    lengths = torch.tensor([len(tokens) for tokens, _ in rows])
    attention_mask = torch.arange(width)[None, :] < lengths[:, None]
    return TensorBatch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask,
                       behavior_logprobs=torch.zeros(n, width),
                       versions=torch.zeros(n, width, dtype=torch.long), rewards=torch.zeros(n))


def _tokens(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=g).tolist()


def grpo_batch(seed: int = 0, group_sizes=(1, 2, 4, 3)) -> TensorBatch:
    """Groups of samples sharing a prompt (9-14 tokens), answers of 2-9 tokens; the last
    group holds two identical answers (every node shared)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for size in group_sizes:
        prompt = _tokens(g, int(torch.randint(9, 15, (1,), generator=g)))
        answers = [_tokens(g, int(torch.randint(2, 10, (1,), generator=g))) for _ in range(size)]
        if size == 3:
            answers[2] = answers[1]
        rows += [(prompt + answer, len(prompt)) for answer in answers]
    return rows_to_batch(rows)


def branching_batch(seed: int = 0) -> TensorBatch:
    """Agent turns that branch: p+x+y, p+x+z, p+w, p+x (a prefix of the first two), and two
    rows that share nothing with the others."""
    g = torch.Generator().manual_seed(seed)
    p, x, y, z, w, q, s = (_tokens(g, n) for n in (12, 5, 4, 6, 7, 10, 5))
    rows = [(p + x + y, 12), (p + x + z, 12), (p + w, 12), (p + x, 12), (q, 3), (s, 2)]
    return rows_to_batch(rows)


def make_engine(path, engine_class=FSDPTrainEngine, **overrides):
    overrides = {"dtype": "float32", "optimizer": OptimizerConfig(lr=1e-3)} | overrides
    spec = TrainEngineSpec(path=path, **overrides)
    engine = engine_class(spec, total_steps=10)
    engine.initialize()
    return engine


# ---- the trie ---------------------------------------------------------------------------------

HAND_ROWS = [
    list(range(1, 12)),  # 11 tokens: 1 .. 11
    list(range(1, 10)) + [20],  # shares 9 with the first
    list(range(1, 9)) + [30, 31, 32, 33],  # shares 8 with both
    [5, 5, 5],  # shares nothing
]


def hand_pack(**kwargs):
    batch = rows_to_batch([(row, 0) for row in HAND_ROWS])
    return batch, pack_prefixes(batch.input_ids, batch.attention_mask, **kwargs)


def test_trie_has_one_node_per_distinct_prefix_at_its_depth():
    batch, pack = hand_pack()
    # 11 + 1 (token 20) + 4 (30 .. 33) + 3 (5 5 5) distinct prefixes of 33 row tokens; both
    # trees fit one packed row (capacity = 2 * 12).
    assert pack.n_nodes == 19 and pack.input_ids.shape == (1, 19)
    assert pack.input_ids[0].tolist() == list(range(1, 12)) + [20, 30, 31, 32, 33, 5, 5, 5]
    assert pack.position_ids[0].tolist() == list(range(11)) + [9, 8, 9, 10, 11, 0, 1, 2]
    assert pack.parent.tolist() == [-1] + list(range(10)) + [8, 7, 12, 13, 14, -1, 16, 17]
    real = batch.attention_mask
    # Each row's token t sits on a node holding that token at depth t.
    assert torch.equal(pack.input_ids.flatten()[pack.node_of[real]], batch.input_ids[real])
    assert pack.node_of[1].tolist() == list(range(9)) + [11, -1, -1]


def test_each_node_attends_exactly_to_its_ancestors_and_itself():
    _, pack = hand_pack()
    mask = pack.attention_mask[0, 0]
    assert pack.attention_mask.shape == (1, 1, 19, 19)
    assert mask[11].nonzero().flatten().tolist() == list(range(9)) + [11]  # token 20
    assert mask[15].nonzero().flatten().tolist() == list(range(8)) + [12, 13, 14, 15]  # 33
    assert mask[18].nonzero().flatten().tolist() == [16, 17, 18]  # the separate tree
    assert mask.sum(-1).tolist() == (pack.position_ids[0] + 1).tolist()  # depth + 1 keys


def test_short_common_prefixes_and_full_trees_start_new_trees():
    # Sorted, the rows share 9, then 8, then 0 tokens with their predecessor.
    _, apart = hand_pack(min_shared=10)  # nothing ties: 4 trees, packed as 12 + 11 | 10 + 3
    assert apart.n_nodes == 11 + 10 + 12 + 3 and apart.input_ids.shape == (2, 23)
    # Capacity 15: rows 0 and 1 make a tree of 12; row 2 would grow it to 16, so it starts a
    # tree of its own (12, its prefix duplicated); the 3-node tree joins the first packed row.
    _, split = hand_pack(capacity=15)
    assert split.n_nodes == 12 + 12 + 3 and split.input_ids.shape == (2, 15)
    assert split.node_of[2, 0] != split.node_of[0, 0]
    assert split.input_ids[0].tolist()[-3:] == [5, 5, 5]
    # Padding nodes see only themselves: no all-masked row for the softmax to turn into NaN.
    assert torch.equal(split.attention_mask[1, 0, 12:, 12:], torch.eye(3, dtype=torch.bool))
    assert not split.attention_mask[1, 0, 12:, :12].any()


def test_rounded_sizes_add_padding_nodes_that_see_only_themselves():
    batch, exact = hand_pack()
    _, pack = hand_pack(node_multiple=8, width_multiple=4)
    # 19 real nodes run as 24, in a row widened from 19 to 20: the 5 padding nodes take its
    # free slot and 4 of a row added for them.
    assert (pack.n_nodes, pack.n_padding, len(pack.slots)) == (19, 5, 24)
    assert pack.input_ids.shape == (2, 20)
    assert pack.slots.tolist() == list(range(20)) + [20, 21, 22, 23]
    padding = torch.tensor([19, 20, 21, 22, 23])
    assert not pack.input_ids.flatten()[padding].any()
    assert not pack.position_ids.flatten()[padding].any()
    assert (pack.parent[padding] == -1).all()
    mask = pack.attention_mask[:, 0].flatten(0, 1)  # [R * L, L], a row's slots as keys
    for slot in padding.tolist():
        assert mask[slot].nonzero().flatten().tolist() == [slot % 20]  # itself only
    # The real nodes keep their tokens, depths, parents and masks, and no token maps to padding.
    real = batch.attention_mask
    assert torch.equal(pack.node_of, exact.node_of)
    assert torch.equal(pack.input_ids[0, :19], exact.input_ids[0])
    assert torch.equal(pack.attention_mask[0, 0, :19, :19], exact.attention_mask[0, 0])
    assert not torch.isin(pack.node_of[real], padding).any()
    # A multiple already met adds nothing.
    _, same = hand_pack(node_multiple=19)
    assert same.n_padding == 0 and same.input_ids.shape == exact.input_ids.shape
    with pytest.raises(ValueError, match="node_multiple and width_multiple must be >= 1"):
        hand_pack(node_multiple=0)


def test_padding_nodes_change_no_log_prob_or_gradient(tiny_path, monkeypatch):
    engine = make_engine(tiny_path)
    batch = branching_batch(seed=3)
    targets = engine_module.targets_loss(batch)
    results = []
    for multiples in ((1, 1), (32, 16)):
        monkeypatch.setattr(engine_module, "SHAPE_MULTIPLES", multiples)
        packs = []

        def recorded(*args, packs=packs, **kwargs):
            packs.append(pack_prefixes(*args, **kwargs))
            return packs[-1]

        monkeypatch.setattr(engine_module, "pack_prefixes", recorded)
        engine.spec = dataclasses.replace(engine.spec, shared_prefix=True)
        logprobs = engine._root_forward(engine.model, batch, targets)
        (-(logprobs * batch.loss_mask).sum()).backward()
        results.append((logprobs.detach(), {name: p.grad.clone()
                                            for name, p in engine.model.named_parameters()}))
        engine.optimizer.zero_grad(set_to_none=True)
        (pack,) = packs
        assert (pack.n_nodes + pack.n_padding) % multiples[0] == 0
        assert pack.input_ids.shape[1] % multiples[1] == 0
        assert (pack.n_padding > 0) == (multiples != (1, 1))
    (exact, exact_grads), (padded, padded_grads) = results
    torch.testing.assert_close(padded, exact, **LOGPROB_TOL)
    for name, grad in exact_grads.items():
        torch.testing.assert_close(padded_grads[name], grad, rtol=0, msg=name,
                                   atol=GRAD_TOL * float(grad.abs().max()))
    engine.destroy()


def test_hf_decoder_on_the_trie_gives_the_unpacked_hidden_states(tiny_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    assert hf.config._attn_implementation == "sdpa"
    batch = branching_batch()
    pack = pack_prefixes(batch.input_ids, batch.attention_mask)
    decoder = hf.get_decoder()
    with torch.no_grad():
        padded = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                         use_cache=False).last_hidden_state
        use_trie_attention(hf)
        nodes = decoder(**pack.model_inputs(), use_cache=False).last_hidden_state
        # Padded batches through the trie attention are SDPA's, number for number.
        again = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                        use_cache=False).last_hidden_state
    assert pack.n_nodes == 12 + 5 + 4 + 6 + 7 + 10 + 5  # p x y z w, then q and s
    assert nodes.shape[:2] == (1, pack.n_nodes)  # the linear layers saw no padding
    assert torch.equal(again, padded)
    packed = pack.to_slots(nodes)  # [1, N, H] -> [R, L, H]
    assert packed.shape[:2] == pack.input_ids.shape
    real = batch.attention_mask
    torch.testing.assert_close(packed.flatten(0, 1)[pack.node_of[real]], padded[real],
                               atol=1e-5, rtol=1e-5)
    padding = torch.ones(pack.input_ids.numel(), dtype=torch.bool)
    padding[pack.slots] = False
    assert padding.sum() == pack.input_ids.numel() - pack.n_nodes
    assert not packed.flatten(0, 1)[padding].any()  # padding slots: 0
    first_feature = pack.unpack(packed[..., 0])  # per node [R, L] -> per token [B, T]
    torch.testing.assert_close(first_feature, padded[..., 0] * real, atol=1e-5, rtol=1e-5)


# ---- the engine: log-probs, entropy, gradients, a step -----------------------------------------

@pytest.mark.parametrize("make_batch", [grpo_batch, branching_batch], ids=["grpo", "branching"])
def test_logprobs_and_entropy_equal_the_padded_path(tiny_path, make_batch):
    engine = make_engine(tiny_path, temperature=0.7)
    batch = make_batch()
    padded = engine.compute_logprobs(batch)
    targets = engine_module.targets_all(batch)
    _, entropy = engine.model(batch.input_ids, batch.attention_mask, targets, with_entropy=True)
    engine.spec = dataclasses.replace(engine.spec, shared_prefix=True)
    shared = engine.compute_logprobs(batch)
    pack = pack_prefixes(batch.input_ids, batch.attention_mask)
    _, shared_entropy = engine.model(batch.input_ids, batch.attention_mask, targets,
                                     with_entropy=True, pack=pack)
    torch.testing.assert_close(shared, padded, **LOGPROB_TOL)
    torch.testing.assert_close(shared_entropy, entropy, **LOGPROB_TOL)
    assert (shared[~batch.attention_mask] == 0).all() and (shared[:, 0] == 0).all()
    assert pack.n_nodes < int(batch.attention_mask.sum())  # prefixes were shared
    engine.destroy()


def test_bf16_compute_on_the_trie_stays_close_to_fp32(tiny_path):
    reference = make_engine(tiny_path)
    expected = reference.compute_logprobs(grpo_batch())
    reference.destroy()
    engine = make_engine(tiny_path, dtype="bfloat16", shared_prefix=True)
    # bf16 compute: about 3 significant digits on log-probs of magnitude ~5 (as padded).
    torch.testing.assert_close(engine.compute_logprobs(grpo_batch()), expected, atol=0.1, rtol=0)
    engine.destroy()


@pytest.mark.parametrize("logits_per_chunk", [2**25, 3 * 320], ids=["one_chunk", "3_per_chunk"])
def test_every_parameter_gradient_equals_the_padded_path(tiny_path, monkeypatch,
                                                         logits_per_chunk):
    # 3 tokens per vocabulary-projection chunk: the chunks recomputed in backward.
    monkeypatch.setattr(logprob_head, "LOGIT_CHUNK_ELEMENTS", logits_per_chunk)
    engine = make_engine(tiny_path)
    batch = grpo_batch(seed=1)
    targets = engine_module.targets_loss(batch)
    pack = pack_prefixes(batch.input_ids, batch.attention_mask)
    grads = []
    for kwargs in ({}, {"pack": pack}):
        logprobs = engine.model(batch.input_ids, batch.attention_mask, targets, **kwargs)
        (-(logprobs * batch.loss_mask).sum()).backward()
        grads.append({name: p.grad.clone()
                      for name, p in engine.model.named_parameters()})
        engine.optimizer.zero_grad(set_to_none=True)
    padded, shared = grads
    assert padded.keys() == shared.keys() and all(g.abs().sum() > 0 for g in padded.values())
    for name, grad in padded.items():
        torch.testing.assert_close(shared[name], grad, rtol=0, msg=name,
                                   atol=GRAD_TOL * float(grad.abs().max()))
    engine.destroy()


# Branching rows of 23, 21, 19 | 17, 10, 5 tokens in 70-token micro-batches; GRPO rows
# (groups of 1, 2, 4, 3) in three micro-batches of 80, the group of 4 split over two.
@pytest.mark.parametrize("make_batch, max_tokens, n_mbs, overrides", [
    (branching_batch, 70, 2, {}), (grpo_batch, 80, 3, {}),
    (grpo_batch, 80, 3, {"gradient_checkpointing": True}),
], ids=["branching", "grpo", "grpo_checkpointed"])
def test_a_micro_batched_step_equals_the_padded_step(tiny_path, make_batch, max_tokens, n_mbs,
                                                     overrides):
    # Adam's first step with eps = 1 is ~lr * grad for these small gradients, so the updated
    # weights also compare the gradients' scale.
    optimizer = OptimizerConfig(lr=1e-2, eps=1.0, gradient_clipping=0.0)
    results = []
    for shared_prefix in (False, True):
        engine = make_engine(tiny_path, optimizer=dataclasses.replace(optimizer),
                             mb_spec=MicroBatchSpec(max_tokens_per_mb=max_tokens),
                             shared_prefix=shared_prefix, **(overrides if shared_prefix else {}))
        stats = engine.train_batch(make_batch(seed=2), nll_loss)
        results.append((stats, engine.hf_state_dict()))
        engine.destroy()
    (padded, params_padded), (shared, params_shared) = results
    assert padded["n_mbs"] == shared["n_mbs"] == n_mbs
    for key in ("loss", "grad_norm", "entropy", "nll_max"):
        assert shared[key] == pytest.approx(padded[key], rel=1e-5), key
    for name, value in params_padded.items():
        torch.testing.assert_close(params_shared[name], value, atol=1e-6, rtol=1e-5, msg=name)


def test_critic_values_and_step_equal_the_padded_path(tiny_path):
    def value_loss(values, mb, *, n_tokens, n_seqs):
        return ((values - 1.0) ** 2 * mb.loss_mask).sum() / n_tokens, {}

    optimizer = OptimizerConfig(lr=1e-2, eps=1.0, gradient_clipping=0.0)
    results = []
    for shared_prefix in (False, True):
        critic = make_engine(tiny_path, FSDPValueEngine, shared_prefix=shared_prefix,
                             optimizer=dataclasses.replace(optimizer))
        values = critic.compute_values(grpo_batch())
        stats = critic.train_batch(grpo_batch(), value_loss)
        results.append((values, stats, critic.hf_state_dict()))
        critic.destroy()
    (values, padded, params_padded), (shared_values, shared, params_shared) = results
    torch.testing.assert_close(shared_values, values, **LOGPROB_TOL)
    assert shared["loss"] == pytest.approx(padded["loss"], rel=1e-5)
    assert shared["grad_norm"] == pytest.approx(padded["grad_norm"], rel=1e-5)
    for name, value in params_padded.items():
        torch.testing.assert_close(params_shared[name], value, atol=1e-6, rtol=1e-5, msg=name)


# ---- configuration ----------------------------------------------------------------------------

def test_the_yaml_key_reaches_the_engine_spec():
    assert TrainEngineConfig(shared_prefix=True).engine_spec(device="cpu").shared_prefix
    assert not TrainEngineConfig().engine_spec(device="cpu").shared_prefix


def test_a_root_without_a_shared_prefix_forward_is_refused(tiny_path):
    from asyncrl.trainer.reward import FSDPRewardEngine

    spec = TrainEngineSpec(path=tiny_path, dtype="float32", shared_prefix=True,
                           mb_spec=MicroBatchSpec(granularity=2))
    engine = FSDPRewardEngine(spec, total_steps=1)
    with pytest.raises(ValueError, match="RewardModel has no shared-prefix forward"):
        engine.initialize()
    engine.destroy()
