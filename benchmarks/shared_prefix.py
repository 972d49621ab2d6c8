"""Forward + backward of a quickstart-shaped batch, padded rows vs their shared-prefix trie.

    python benchmarks/shared_prefix.py                                  # tiny random model
    python benchmarks/shared_prefix.py --model smollm2-135m-instruct    # the quickstart's
    python benchmarks/shared_prefix.py --groups 8 --samples 16 --dtype bfloat16
    python benchmarks/shared_prefix.py --images --model runs/smolvlm-shapes --groups 16 \
        --samples 8 --dtype bfloat16                                    # the VLM example's

`--images`: a vision-language model's batch instead, as the VLM example's GRPO makes it:
each group one generated scene (`asyncrl.data.visual_tasks`) and its question in the
model's chat template, image tokens included, with answers of 1-3 random tokens. Without
`--model`, a tiny random Idefics3.

The batch: `--groups` prompts of `--prompt` random tokens, `--samples` answers each of 10-40
random tokens (the quickstart: 8 x 4, ~75-token prompts). For each path it prints the
tokens the model runs (padded rows vs packed trie nodes, padding included, summed over
micro-batches), the real tokens or distinct nodes among them, and the median time of one
forward + backward of the policy loss over the batch's micro-batches (no optimiser step),
of which the trie building (on the CPU) is also shown.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from asyncrl.api.types import Batch, TensorBatch, Trajectory
from asyncrl.config.engine import MicroBatchSpec, TrainEngineSpec
from asyncrl.trainer import FSDPTrainEngine
from asyncrl.trainer.microbatch import to_device
from asyncrl.trainer.prefix import pack_prefixes
from asyncrl.trainer.vision import image_keys


def quickstart_batch(groups: int, samples: int, prompt: int, seed: int = 0) -> TensorBatch:
    """`groups` random prompts, each with `samples` random answers of 10-40 tokens."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(groups):
        head = torch.randint(3, 250, (prompt,), generator=g)
        for _ in range(samples):
            answer = torch.randint(3, 250, (int(torch.randint(10, 41, (1,), generator=g)),),
                                   generator=g)
            rows.append(torch.cat([head, answer]))
    width = max(len(r) for r in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, :len(r)] = r
    lengths = torch.tensor([len(r) for r in rows])
    attention_mask = torch.arange(width)[None, :] < lengths[:, None]
    loss_mask = (attention_mask & (torch.arange(width)[None, :] >= prompt)).float()
    n = len(rows)
    return TensorBatch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask,
                       behavior_logprobs=torch.zeros(n, width),
                       versions=torch.zeros(n, width, dtype=torch.long), rewards=torch.zeros(n))


def image_batch(model: str, groups: int, samples: int, seed: int = 0) -> TensorBatch:
    """`groups` generated scenes with their questions, each with `samples` answers of 1-3
    random tokens."""
    from asyncrl.data.visual_tasks import train_tasks
    from asyncrl.openai.images import load_image_prompts

    prompts = load_image_prompts(model)
    tok = prompts.processor.tokenizer
    g = torch.Generator().manual_seed(seed)
    out = []
    for item in train_tasks(size=groups, seed=seed):
        text = tok.apply_chat_template([
            {"role": "system", "content": "Look at the image and answer with one word or number."},
            {"role": "user", "content": prompts.image_text + item["question"]}],
            add_generation_prompt=True, tokenize=False)
        prompt, images = prompts.encode(text, [prompts.decode_url(item["images"][0], "image")])
        for _ in range(samples):
            answer = torch.randint(3, 250, (int(torch.randint(1, 4, (1,), generator=g)),),
                                   generator=g).tolist()
            n = len(prompt) + len(answer)
            out.append(Trajectory(
                input_ids=prompt + answer, loss_mask=[0] * len(prompt) + [1] * len(answer),
                behavior_logprobs=[0.0] * n, versions=[-1] * len(prompt) + [0] * len(answer),
                reward=0.0, group_id=item["id"], images=images))
    return Batch(out).to_tensors()


def trie_of(engine: FSDPTrainEngine, mb: TensorBatch):
    """The trie the engine runs `mb` as (image tokens keyed by their pixels)."""
    keys = None
    if mb.pixel_values is not None:
        keys = image_keys(mb.input_ids, engine.model.hf.config.image_token_id, mb.images,
                          mb.image_rows)
    return pack_prefixes(mb.input_ids, mb.attention_mask, keys=keys)


def token_counts(engine: FSDPTrainEngine, batch: TensorBatch) -> dict[str, int]:
    """Tokens the model runs per path, summed over this rank's micro-batches."""
    counts = {"real tokens": 0, "padded tokens": 0, "trie nodes": 0, "packed tokens": 0}
    for rows, _ in engine._my_micro_batches(batch):
        mb = batch.select(rows)
        pack = trie_of(engine, mb)
        counts["real tokens"] += int(mb.attention_mask.sum())
        counts["padded tokens"] += mb.input_ids.numel()
        counts["trie nodes"] += pack.n_nodes
        counts["packed tokens"] += pack.input_ids.numel()
    return counts


def forward_backward(engine: FSDPTrainEngine, batch: TensorBatch) -> float:
    """Seconds of one forward + backward of the token NLL over the batch's micro-batches."""
    model = engine.model
    model.train()
    n_tokens = int((batch.loss_mask > 0).sum())
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for rows, _ in engine._my_micro_batches(batch):
        mb = to_device(batch.select(rows), engine.device)
        logprobs, _ = engine._train_forward(model, mb, n_tokens)
        (-(logprobs * mb.loss_mask).sum() / n_tokens).backward()
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    engine.optimizer.zero_grad(set_to_none=True)
    return elapsed


def pack_seconds(engine: FSDPTrainEngine, batch: TensorBatch) -> float:
    start = time.perf_counter()
    for rows, _ in engine._my_micro_batches(batch):
        trie_of(engine, batch.select(rows))
    return time.perf_counter() - start


def batch_arguments(description: str, *, dtype: str, max_tokens_per_mb: int,
                    repeats: int) -> argparse.ArgumentParser:
    """The model and quickstart-shaped batch options these benchmarks share."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default=None,
                        help="an HF folder or named model (default: a tiny random model)")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=75)
    parser.add_argument("--dtype", default=dtype, choices=["float32", "bfloat16"])
    parser.add_argument("--max-tokens-per-mb", type=int, default=max_tokens_per_mb)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the train engine runs (default: cuda when a GPU shows)")
    return parser


def main() -> None:
    parser = batch_arguments(__doc__.split("\n")[0], dtype="float32", max_tokens_per_mb=8192,
                             repeats=5)
    parser.add_argument("--images", action="store_true",
                        help="a vision-language batch (scenes and questions; --prompt unused)")
    args = parser.parse_args()

    if args.model is None and args.images:
        from asyncrl.models.tiny_vlm import make_tiny_vlm

        args.model = make_tiny_vlm(tempfile.mkdtemp() + "/tiny-vlm")
    elif args.model is None:
        from asyncrl.models.tiny import make_tiny_model

        args.model = make_tiny_model(tempfile.mkdtemp() + "/tiny")
    if args.images:
        batch = image_batch(args.model, args.groups, args.samples)
        shape = "a scene and its question each, answers 1-3"
    else:
        batch = quickstart_batch(args.groups, args.samples, args.prompt)
        shape = f"prompt {args.prompt}, answers 10-40"
    results = {}
    for shared in (False, True):
        spec = TrainEngineSpec(path=args.model, dtype=args.dtype, shared_prefix=shared,
                               mb_spec=MicroBatchSpec(max_tokens_per_mb=args.max_tokens_per_mb),
                               device=args.device)
        engine = FSDPTrainEngine(spec, total_steps=1)
        engine.initialize()
        forward_backward(engine, batch)  # warm-up
        times = [forward_backward(engine, batch) for _ in range(args.repeats)]
        results[shared] = statistics.median(times)
        if shared:
            counts = token_counts(engine, batch)
            building = statistics.median(pack_seconds(engine, batch) for _ in range(3))
        engine.destroy()
    print(f"batch: {args.groups} groups x {args.samples} samples, {shape}; model "
          f"{args.model}, {args.dtype}, device {engine.device}")
    print(f"tokens run   padded {counts['padded tokens']:6d} (real {counts['real tokens']})"
          f"   shared-prefix {counts['packed tokens']:6d} (nodes {counts['trie nodes']})")
    print(f"fwd+bwd (s)  padded {results[False]:.4f}   shared-prefix {results[True]:.4f} "
          f"(of which trie building {building:.4f})   speed-up "
          f"{results[False] / results[True]:.2f}x")


if __name__ == "__main__":
    main()
