"""Generation of a vision-language GRPO batch on our engine, with shared prefixes and
without, in one run.

    python examples/vlm/build_model.py --out runs/smolvlm-shapes
    python benchmarks/vlm_generation.py --model runs/smolvlm-shapes

The batch is a GRPO step's: --groups scenes of the visual task (asyncrl.data.visual_tasks),
each asked once and sampled --samples times, all submitted at once, as the rollout does.
Every request generates exactly --new-tokens tokens (EOS ignored), so both sides do the
same work. "shared" is the engine as it serves: a group's samples run the vision encoder
and the prompt once (their image tokens are keyed by the pixels). "unshared" computes every
prompt in full (shared prefixes off). The sides alternate --repeats times; the table gives
each side's median wall time, the rows the decoder ran and the images the encoder ran, and
the ratio. Weights need not be trained: the work does not depend on them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from asyncrl.api.types import GenerationRequest, SamplingParams
from asyncrl.config.schema import LocalEngineConfig
from asyncrl.data.visual_tasks import train_tasks
from asyncrl.inference.server import engine as engine_module
from asyncrl.inference.server.engine import LocalEngine
from asyncrl.openai.images import load_image_prompts

SYSTEM = "Look at the image and answer with one word or number."


def group_requests(model: str, groups: int, samples: int, new_tokens: int,
                   seed: int) -> list[GenerationRequest]:
    """`samples` requests for each of `groups` generated scenes, as the rollout sends them."""
    prompts = load_image_prompts(model)
    tok = prompts.processor.tokenizer
    reqs = []
    for g, item in enumerate(train_tasks(size=groups, seed=seed)):
        text = tok.apply_chat_template(
            [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": prompts.image_text + item["question"]}],
            add_generation_prompt=True, tokenize=False)
        ids, images = prompts.encode(text, [prompts.decode_url(item["images"][0], "image")])
        for s in range(samples):
            reqs.append(GenerationRequest(input_ids=ids, images=images, sampling=SamplingParams(
                temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True,
                seed=seed * 100_003 + g * samples + s)))
    return reqs


def generate(engine: LocalEngine, reqs: list[GenerationRequest]) -> dict[str, float]:
    """Serve `reqs` (submitted at once) to the end, stepping the engine by hand."""
    rows, images = [], []
    forward, embed = engine.model.forward_rows, engine.vision.embed
    engine.model.forward_rows = lambda tokens, *a: rows.append(len(tokens)) or forward(tokens, *a)
    engine.vision.embed = lambda im: images.append(im.n_items) or embed(im)
    done: list = []
    t0 = time.perf_counter()
    for req in reqs:
        engine.submit(req, done.append)
    while len(done) < len(reqs):
        engine.step()
    wall = time.perf_counter() - t0
    engine.model.forward_rows, engine.vision.embed = forward, embed
    failed = [r for r in done if isinstance(r, BaseException)]
    if failed:
        raise failed[0]
    return {"wall": wall, "rows": sum(rows), "images": sum(images)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a SmolVLM-shaped (Idefics3) folder")
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    reqs = group_requests(args.model, args.groups, args.samples, args.new_tokens, args.seed)
    engine = LocalEngine(args.model, LocalEngineConfig(
        dtype=args.dtype, max_batch_size=args.max_batch_size, max_seq_len=256), seed=args.seed)
    if not engine.model.fused:
        raise SystemExit("shared prefixes run on the one-call C forward (AVX512-BF16 and "
                         "--dtype bfloat16); this machine or dtype does not take it")
    share = engine_module.MIN_SHARED_PREFIX
    generate(engine, reqs[:args.samples])  # warm-up: scratch buffers, thread pools
    runs: dict[str, list[dict[str, float]]] = {"shared": [], "unshared": []}
    for _ in range(args.repeats):
        for side, min_shared in (("shared", share), ("unshared", 10**9)):
            engine_module.MIN_SHARED_PREFIX = min_shared
            runs[side].append(generate(engine, reqs))
    engine_module.MIN_SHARED_PREFIX = share

    n_prompt = len(reqs[0].input_ids)
    print(f"{args.groups} groups x {args.samples} samples, prompts of {n_prompt} tokens "
          f"({reqs[0].images.n_items} image tile(s) each), {args.new_tokens} new tokens, "
          f"{args.dtype}, {torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"{'side':<10}{'wall s':>9}{'tok/s':>9}{'decoder rows':>14}{'encoder images':>16}")
    med = {}
    for side, rs in runs.items():
        med[side] = statistics.median(r["wall"] for r in rs)
        print(f"{side:<10}{med[side]:>9.2f}{len(reqs) * args.new_tokens / med[side]:>9.1f}"
              f"{int(rs[0]['rows']):>14}{int(rs[0]['images']):>16}")
    print(f"shared is {med['unshared'] / med['shared']:.2f}x faster")


if __name__ == "__main__":
    main()
