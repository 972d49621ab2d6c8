"""Tiny random models with a byte-level tokenizer, built at test time (no downloads)."""

from __future__ import annotations

from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# A tiny qwen3_moe's MoE keys: 8 experts, 2 per token, in every layer.
TINY_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": False,
            "output_router_logits": False, "router_aux_loss_coef": 0.0}


def make_tiny_tokenizer():
    """A byte-level tokenizer: every byte is one token, plus ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS,
        chat_template=CHATML_TEMPLATE,
    )


def make_tiny_model(path: str | Path, *, arch: str = "llama", seed: int = 0,
                    hidden_size: int = 64, num_layers: int = 2, num_heads: int = 2,
                    num_kv_heads: int = 1, head_dim: int = 32, intermediate_size: int = 128,
                    tie_word_embeddings: bool = True, max_position_embeddings: int = 2048,
                    vocab_size: int | None = None, moe: dict | None = None) -> str:
    """Save a randomly initialised `arch` model (llama | qwen2 | qwen3 | qwen3_moe) and
    tokenizer to `path`. `vocab_size`: the embedding's rows (default: the tokenizer's,
    rounded up to 64); a larger one gives a real model's head cost to a benchmark that
    feeds token ids itself. `moe`: qwen3_moe's config keys over TINY_MOE's."""
    import torch
    import transformers

    tokenizer = make_tiny_tokenizer()
    if vocab_size is None:
        vocab_size = (len(tokenizer) + 63) // 64 * 64
    elif vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size={vocab_size} is below the tokenizer's {len(tokenizer)} "
                         "tokens")
    common = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }
    if arch not in classes:
        raise ValueError(f"arch {arch!r} is not one of {sorted(classes)}")
    if arch == "qwen3_moe":
        common |= TINY_MOE | (moe or {})
    elif moe:
        raise ValueError(f"moe={moe} is for arch='qwen3_moe', not {arch!r}")
    config_cls, model_cls = classes[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common))
    # Random init with std 0.02 gives near-uniform outputs; a larger scale gives the tiny
    # model peaked, input-dependent distributions, which makes sampling tests meaningful.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # 3: stacked experts [experts, out, in]
                p.normal_(0.0, 0.2 if "embed" in name else 1.0 / p.shape[-1] ** 0.5)
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
