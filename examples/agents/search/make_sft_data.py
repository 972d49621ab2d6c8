"""Worked search episodes as SFT rows: a warm start that teaches SmolLM2 the call format.

    python examples/agents/search/make_sft_data.py --out runs/search_sft.jsonl --size 256

Each row is one training-split one-hop question done right, as the agent's conversation
in the text the proxy shows the model (SmolLM2's template has no tools, so tools, calls and
results are written in the Hermes form): the agent's own prompt (system text with the tool
block, its two worked examples), the question, "I will search for it." and a `search` call
for the question's subject, the tool's real result, the tagged answer. `asyncrl sft` learns every assistant turn (`examples/sft/search_sft_cpu.yaml`);
the RL run then starts from it (`search_cpu.yaml actor.path=<checkpoint>`). Validation
questions are never used.
"""

import argparse
import asyncio
import json
from pathlib import Path

from asyncrl.agents.search import FEW_SHOT, SYSTEM_PROMPT, SearchTool, make_corpus, search_items
from asyncrl.agents.tools import ToolBox
from asyncrl.services.tool_calls import hermes_messages


def episode(item: dict, subjects: dict[str, str]) -> dict:
    toolbox = ToolBox([SearchTool.for_item(item)])
    query = subjects[item["metadata"]["supporting_doc_ids"][0]]
    call = {"id": "call_0", "type": "function",
            "function": {"name": "search", "arguments": json.dumps({"query": query})}}
    [result] = asyncio.run(toolbox.run_tool_calls([call]))
    answer = item["answer"]
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, *FEW_SHOT,
                {"role": "user", "content": item["question"]},
                {"role": "assistant", "content": "I will search for it.", "tool_calls": [call]},
                result,
                {"role": "assistant", "content": f"The answer is {answer}.\n<answer>{answer}</answer>"}]
    return {"messages": hermes_messages(messages, toolbox.specs, None)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-seed", type=int, default=0)
    p.add_argument("--n-entities", type=int, default=200)
    args = p.parse_args()
    items = search_items(size=args.size, seed=args.seed, corpus_seed=args.corpus_seed,
                         n_entities=args.n_entities, hops=[1], split="train")
    subjects = {d["id"]: d["subject"] for d in make_corpus(args.corpus_seed, args.n_entities)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for item in items:
            f.write(json.dumps(episode(item, subjects)) + "\n")
    print(f"{len(items)} worked episodes -> {out}")


if __name__ == "__main__":
    main()
