"""Worked search episodes as SFT rows: a warm start that teaches SmolLM2 the call format.

    python examples/agents/search/make_sft_data.py --out runs/search_sft.jsonl --size 384 \
        --hops 1 2                       # half one-hop, half two-hop (--two-hop-fraction)

Each row is one training-split question done right, as the agent's conversation in the
text the proxy shows the model (SmolLM2's template has no tools, so tools, calls and
results are written in the Hermes form): the agent's own prompt (system text with the tool
block, its two worked examples), the question, a `search` call for the question's subject,
the tool's real result, and the tagged answer. Every turn opens with what the question asks
for ("The question asks for a province. I will search for Orla Fennick."); a turn after a
result says what the result names and decides from the two: "... Brask is a town, so I
will search for Brask." (a two-hop question's second call, as the agent's third turn
allows) or "... Lorvel is a province, so the answer is Lorvel." and the tagged answer.
`asyncrl sft` learns every assistant turn (`examples/sft/search_sft_cpu.yaml`); the RL run
then starts from it (`search_cpu.yaml actor.path=<checkpoint>`). Validation questions are
never used.
"""

import argparse
import asyncio
import json
import random
from pathlib import Path

from asyncrl.agents.search import (
    FEW_SHOT,
    OBJECT_KIND,
    SYSTEM_PROMPT,
    SearchTool,
    asks_for,
    found,
    make_corpus,
    search_items,
)
from asyncrl.agents.tools import ToolBox
from asyncrl.openai.tool_calls import hermes_messages


def _call(i: int, query: str) -> dict:
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": "search", "arguments": json.dumps({"query": query})}}


def episode(item: dict, docs: dict[str, dict]) -> dict:
    """The conversation of one item done right: one search per supporting document.

    Every turn opens with what the question asks for; each turn after a result says what
    kind of thing the result names and decides right there: answer, or search for it.
    """
    toolbox = ToolBox([SearchTool.for_item(item)])
    chain = [docs[d] for d in item["metadata"]["supporting_doc_ids"]]
    kind = OBJECT_KIND[chain[-1]["relation"]]
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, *FEW_SHOT,
                {"role": "user", "content": item["question"]}]
    lead = f"{asks_for(kind)} I will search for {chain[0]['subject']}."
    for i, doc in enumerate(chain):
        call = _call(i, doc["subject"])
        [result] = asyncio.run(toolbox.run_tool_calls([call]))
        messages += [{"role": "assistant", "content": lead, "tool_calls": [call]}, result]
        lead = found(kind, doc["object"], OBJECT_KIND[doc["relation"]])
    messages.append({"role": "assistant", "content": lead})
    return {"messages": hermes_messages(messages, toolbox.specs, None)}


def worked_items(size: int, seed: int, corpus_seed: int, n_entities: int, hops: list[int],
                 two_hop_fraction: float) -> list[dict]:
    """`size` training questions: one-hop, plus `two_hop_fraction` of two-hop ones if asked."""
    n_two = round(size * two_hop_fraction) if 2 in hops else 0
    n_one = size - n_two if 1 in hops else 0
    if n_one + n_two != size:
        raise ValueError(f"--hops {hops} with --two-hop-fraction {two_hop_fraction} cannot "
                         f"give {size} rows; use --hops 1 2 or a fraction of 0 or 1")
    kw = {"seed": seed, "corpus_seed": corpus_seed, "n_entities": n_entities, "split": "train"}
    if not n_two or not n_one:  # one kind: in search_items' order
        return search_items(size=size, hops=[2 if n_two else 1], **kw)
    items = search_items(size=n_one, hops=[1], **kw) + search_items(size=n_two, hops=[2], **kw)
    random.Random(seed).shuffle(items)  # the kinds mixed within every SFT batch
    return items


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-seed", type=int, default=0)
    p.add_argument("--n-entities", type=int, default=200)
    p.add_argument("--hops", type=int, nargs="+", default=[1], choices=[1, 2])
    p.add_argument("--two-hop-fraction", type=float, default=0.5,
                   help="share of two-hop rows when --hops has 2 (default 0.5)")
    args = p.parse_args()
    items = worked_items(args.size, args.seed, args.corpus_seed, args.n_entities, args.hops,
                         args.two_hop_fraction)
    docs = {d["id"]: d for d in make_corpus(args.corpus_seed, args.n_entities)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for item in items:
            f.write(json.dumps(episode(item, docs)) + "\n")
    print(f"{len(items)} worked episodes -> {out}")


if __name__ == "__main__":
    main()
