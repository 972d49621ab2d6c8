"""Build a SmolVLM-shaped (Idefics3) model folder from a text model's weights.

    python examples/vlm/build_model.py --out runs/smolvlm-shapes \
        --source smollm2-135m-instruct

The text model is the source's, tensor for tensor (its embedding and head grow by the
image tokens' rows, set to the mean of the source's rows); the vision encoder (a SigLIP-
style ViT) and the connector (pixel shuffle, then a linear map into the text model's width)
are new and randomly initialised, small enough to train on a CPU. The processor is the
source's tokenizer with Idefics3's image tokens added and an image processor that shows
each image as one tile of `--image-size` pixels (no splitting: the task's images are small),
so an image is (image_size / patch / scale_factor)^2 image tokens.

The folder loads with AutoModelForImageTextToText and AutoProcessor, and serves and trains
like any SmolVLM folder. Until the vision side is trained (pretrain_vision.py, then
shapes_align_sft_cpu.yaml) the image tokens carry noise.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers
from transformers.models.idefics3 import Idefics3ImageProcessorPil, Idefics3Processor

from asyncrl.models.hub import resolve_model_path
from asyncrl.models.tiny_vlm import IMAGE_TOKEN, VLM_CHAT_TEMPLATE, VLM_TOKENS


def vision_config(image_size: int, patch: int, hidden: int, layers: int,
                  heads: int) -> transformers.Idefics3VisionConfig:
    """The vision encoder's config; errors name the option to change."""
    if hidden % heads:
        raise ValueError(f"--vision-hidden {hidden} must be a multiple of --vision-heads {heads}")
    return transformers.Idefics3VisionConfig(
        hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, image_size=image_size, patch_size=patch)


def build(source: str, out: str | Path, *, image_size: int = 64, patch: int = 8,
          scale_factor: int = 2, vision_hidden: int = 192, vision_layers: int = 4,
          vision_heads: int = 3, seed: int = 0) -> str:
    """Write the model, tokenizer and processor to `out`; returns the folder."""
    if image_size % patch:
        raise ValueError(f"--image-size {image_size} must be a multiple of --patch {patch}")
    if (image_size // patch) % scale_factor:
        raise ValueError(f"--scale-factor {scale_factor} must divide the {image_size // patch} "
                         f"patches per side (--image-size {image_size} / --patch {patch})")
    src_path = resolve_model_path(source)
    tokenizer = transformers.AutoTokenizer.from_pretrained(src_path)
    lm = transformers.AutoModelForCausalLM.from_pretrained(src_path, dtype=torch.float32)
    if lm.config.model_type != "llama":
        raise ValueError(f"{source} is a {lm.config.model_type} model; Idefics3's text model "
                         "here is a Llama decoder (SmolLM2 is one)")
    src_vocab = lm.get_input_embeddings().weight.shape[0]
    tokenizer.add_special_tokens({"additional_special_tokens": VLM_TOKENS})
    text = lm.config.to_dict()
    text["vocab_size"] = max(src_vocab, (len(tokenizer) + 63) // 64 * 64)
    tied = bool(lm.config.tie_word_embeddings)
    config = transformers.Idefics3Config(
        text_config=text, scale_factor=scale_factor,
        vision_config=vision_config(image_size, patch, vision_hidden, vision_layers,
                                    vision_heads).to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), tie_word_embeddings=tied,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = transformers.Idefics3ForConditionalGeneration(config)
    copy_text_weights(lm, model, src_vocab)
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": image_size},
        max_image_size={"longest_edge": image_size})
    processor = Idefics3Processor(
        image_processor=image_processor, tokenizer=tokenizer,
        image_seq_len=(image_size // patch // scale_factor) ** 2, chat_template=VLM_CHAT_TEMPLATE)
    out = Path(out)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return str(out)


@torch.no_grad()
def copy_text_weights(lm: torch.nn.Module, vlm: torch.nn.Module, src_vocab: int) -> None:
    """The source decoder's tensors into the VLM's text model, every one of them; the new
    token rows of the embedding (and an untied head) get the mean of the source's rows."""
    target = vlm.model.text_model
    src = lm.model.state_dict()
    missing = set(target.state_dict()) ^ set(src)
    if missing:
        raise ValueError(f"the source decoder and Idefics3's text model differ in "
                         f"{sorted(missing)}")
    for name, tensor in target.state_dict().items():
        if name == "embed_tokens.weight":
            tensor[:src_vocab] = src[name]
            tensor[src_vocab:] = src[name].mean(0)
        else:
            tensor.copy_(src[name])
    if not vlm.config.tie_word_embeddings:
        head = lm.get_output_embeddings().weight
        vlm.lm_head.weight[:src_vocab] = head
        vlm.lm_head.weight[src_vocab:] = head.mean(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the new model folder")
    parser.add_argument("--source", default="smollm2-135m-instruct",
                        help="the text model: a folder or a named model")
    parser.add_argument("--image-size", type=int, default=64, help="pixels per side")
    parser.add_argument("--patch", type=int, default=8, help="the ViT's patch, in pixels")
    parser.add_argument("--scale-factor", type=int, default=2,
                        help="the connector merges scale x scale patches into one image token")
    parser.add_argument("--vision-hidden", type=int, default=192)
    parser.add_argument("--vision-layers", type=int, default=4)
    parser.add_argument("--vision-heads", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = build(args.source, args.out, image_size=args.image_size, patch=args.patch,
                 scale_factor=args.scale_factor, vision_hidden=args.vision_hidden,
                 vision_layers=args.vision_layers, vision_heads=args.vision_heads,
                 seed=args.seed)
    print(path)


if __name__ == "__main__":
    main()
