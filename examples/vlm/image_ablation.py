"""Does a model answer from the image? Greedy accuracy on the generated visual task with
each item's own image and with a blank white one.

    python examples/vlm/image_ablation.py --model runs/vlm-shapes-sft-cpu/trial0/checkpoints/step300

prints, for new training-split scenes and for held-out ones, how many answers are right
with the image and with the blank canvas. A model whose vision side carries nothing scores
about the same on both: it answers from the question alone (the likeliest count, "yes",
the commonest colour). HF generate, one item at a time, on the CPU.
"""

import argparse

import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from asyncrl.data.offline import load_image
from asyncrl.data.visual_tasks import BACKGROUND, held_out_tasks, train_tasks
from asyncrl.rewards.short_answer import short_answer_reward

SYSTEM = "Look at the image and answer with one word or number."  # shapes_grpo_cpu.yaml's


def image_of(item: dict) -> Image.Image:
    return load_image(item["images"][0], f"item {item['id']} images[0]")


@torch.no_grad()
def answer(model, processor, question: str, image: Image.Image, max_new_tokens: int) -> str:
    messages = [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
                {"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=text, images=[image], return_tensors="pt", add_special_tokens=False)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:],
                                      skip_special_tokens=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a vision-language HF folder")
    parser.add_argument("--size", type=int, default=48, help="items per split")
    parser.add_argument("--seed", type=int, default=7, help="the training-split scenes' seed "
                        "(the SFT rows are seed 0, GRPO's seed 1)")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args()
    processor = AutoProcessor.from_pretrained(args.model)
    model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=torch.float32).eval()
    splits = {"new training-split scenes": train_tasks(size=args.size, seed=args.seed),
              "held-out scenes (seed 0)": held_out_tasks(size=args.size, seed=0)}
    for name, items in splits.items():
        blank = Image.new("RGB", image_of(items[0]).size, BACKGROUND)
        right = {"image": 0, "blank": 0}
        for item in items:
            for kind, image in (("image", image_of(item)), ("blank", blank)):
                said = answer(model, processor, item["question"], image, args.max_new_tokens)
                right[kind] += short_answer_reward(said, item) == 1.0
        print(f"{name}: {right['image']} of {len(items)} right with the image, "
              f"{right['blank']} with a blank one", flush=True)


if __name__ == "__main__":
    main()
