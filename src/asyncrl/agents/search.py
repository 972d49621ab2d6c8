"""A search-agent task: questions about a generated corpus that only a `search` tool knows.

The corpus describes made-up people, towns, provinces, inventions and companies, one fact
per short document, so no pretrained model can answer from memory: it has to call
`search(query)` (BM25 over the corpus) and copy the answer out of the result. A 1-hop
question needs one document ("In which town was Velmora Quist born?"), a 2-hop question
needs two ("In which province was Velmora Quist born?": her town, then the town's province).

Documents are worded so that the bare name of a question's entity retrieves that
question's supporting document first: a person's birth document and a town's location
document are the shortest documents that contain the name, and BM25 favours short ones.

Answers go inside <answer></answer>; `score_answer` reads the last such tag.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Sequence
from typing import Any, ClassVar

# -- corpus ---------------------------------------------------------------------------

_ONSETS = ["b", "br", "d", "dr", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "th",
           "v", "w", "z"]
_VOWELS = ["a", "e", "i", "o", "u"]
_MIDDLES = ["l", "n", "r", "m", "v", "d", "s", "t", "k", "ll", "nn", "rr", "nd", "rv", "lm"]
_ENDS = ["", "n", "ck", "l", "r", "s", "th", "x", "ra", "na", "vel", "mar", "wick"]
_THINGS = ["Lantern", "Compass", "Loom", "Kettle", "Engine", "Telescope", "Clock", "Pump",
           "Press", "Lens", "Bellows", "Sextant"]
_FIRMS = ["Works", "Mills", "Foundry", "Trading", "Shipyards", "Brewery"]


def _word(rng: random.Random, taken: set[str]) -> str:
    """A new made-up, pronounceable capitalised word ("Velmora", "Drennick")."""
    while True:
        w = (rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_MIDDLES)
             + rng.choice(_VOWELS) + rng.choice(_ENDS)).capitalize()
        if w not in taken:
            taken.add(w)
            return w


def make_corpus(seed: int, n_entities: int) -> list[dict[str, Any]]:
    """The documents for `n_entities` people (plus their towns, provinces, inventions, firms).

    Each doc: {"id", "text", "relation", "subject", "object"}; the same seed gives the same docs.
    """
    if n_entities < 4:
        raise ValueError(f"n_entities must be >= 4, got {n_entities}")
    rng = random.Random(f"search-corpus-{seed}")
    taken: set[str] = set()
    firsts = [_word(rng, taken) for _ in range(max(8, n_entities // 3))]
    lasts = [_word(rng, taken) for _ in range(max(8, n_entities // 2))]
    people: list[str] = []
    seen: set[str] = set()
    while len(people) < n_entities:
        name = f"{rng.choice(firsts)} {rng.choice(lasts)}"
        if name not in seen:
            seen.add(name)
            people.append(name)
    provinces = [_word(rng, taken) for _ in range(max(3, n_entities // 25))]
    towns = [_word(rng, taken) for _ in range(max(4, n_entities // 5))]
    inventions = [f"{_word(rng, taken)} {rng.choice(_THINGS)}" for _ in range(n_entities // 2)]
    firms = [f"{_word(rng, taken)} {rng.choice(_FIRMS)}" for _ in range(n_entities // 2)]

    facts: list[tuple[str, str, str, str]] = []  # (relation, subject, object, text)
    for i, town in enumerate(towns):  # every province gets a town before any gets two
        prov = provinces[i] if i < len(provinces) else rng.choice(provinces)
        facts.append(("located_in", town, prov, f"{town} is located in the province of {prov}."))
    for i, person in enumerate(people):
        town = towns[i] if i < len(towns) else rng.choice(towns)
        facts.append(("born_in", person, town, f"{person} was born in the town of {town}."))
    for thing, person in zip(inventions, rng.sample(people, len(inventions))):
        facts.append(("invented_by", thing, person,
                      f"The {thing} is a device that was invented by {person}."))
    for firm, person in zip(firms, rng.sample(people, len(firms))):
        facts.append(("founded_by", firm, person, f"{person} founded the company {firm}."))
    rng.shuffle(facts)  # doc ids say nothing about the relation
    return [{"id": f"d{i:05d}", "text": text, "relation": rel, "subject": subj, "object": obj}
            for i, (rel, subj, obj, text) in enumerate(facts)]


# -- questions ------------------------------------------------------------------------

_ONE_HOP = {
    "born_in": "In which town was {s} born?",
    "located_in": "In which province is the town of {s}?",
    "invented_by": "Who invented the {s}?",
    "founded_by": "Who founded {s}?",
}
# (first relation, second relation, template): the first doc's object is the second's subject.
_TWO_HOP = [
    ("born_in", "located_in", "In which province was {s} born?"),
    ("invented_by", "born_in", "In which town was the inventor of the {s} born?"),
    ("founded_by", "born_in", "In which town was the founder of {s} born?"),
]
HELD_OUT_FRACTION = 0.2


def all_questions(corpus: list[dict[str, Any]], hops: list[int]) -> list[dict[str, Any]]:
    """Every question the corpus supports with the given hop counts, in corpus order."""
    by_subject = {(d["relation"], d["subject"]): d for d in corpus}
    out = []
    for doc in corpus:
        if 1 in hops:
            out.append({"question": _ONE_HOP[doc["relation"]].format(s=doc["subject"]),
                        "answer": doc["object"], "hops": 1, "supporting_doc_ids": [doc["id"]]})
        if 2 in hops:
            for first, second, template in _TWO_HOP:
                nxt = by_subject.get((second, doc["object"]))
                if doc["relation"] == first and nxt is not None:
                    out.append({"question": template.format(s=doc["subject"]),
                                "answer": nxt["object"], "hops": 2,
                                "supporting_doc_ids": [doc["id"], nxt["id"]]})
    if bad := set(hops) - {1, 2}:
        raise ValueError(f"hops must be a subset of [1, 2], got {sorted(bad)}")
    return out


def held_out_question(corpus_seed: int, question: str) -> bool:
    """Whether `question` is in corpus `corpus_seed`'s held-out part (a stable hash)."""
    digest = hashlib.sha256(f"search-split-{corpus_seed}:{question}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < HELD_OUT_FRACTION * 2**64


def search_items(size: int, seed: int, corpus_seed: int = 0, n_entities: int = 200,
                 hops: Sequence[int] = (1,), split: str = "train", **_: Any) -> list[dict[str, Any]]:
    """`size` questions about corpus `corpus_seed`, drawn with `seed` from `split`.

    Each question of the corpus belongs to the held-out "valid" part or to the train part
    by a hash of the question (HELD_OUT_FRACTION of them held out), so its part is the same
    whichever `hops` are asked for: one-hop, two-hop and mixed sets never share a question
    across parts. Seeds only choose within a part.
    """
    if split not in ("train", "valid"):
        raise ValueError(f"split must be 'train' or 'valid', got {split!r}")
    pool = all_questions(make_corpus(corpus_seed, n_entities), list(hops))
    part = [q for q in pool if held_out_question(corpus_seed, q["question"]) == (split == "valid")]
    if size > len(part):
        raise ValueError(f"asked for {size} {split} questions but corpus {corpus_seed} with "
                         f"n_entities={n_entities}, hops={list(hops)} has {len(part)}; "
                         "raise n_entities or lower size")
    chosen = random.Random(f"search-items-{seed}").sample(part, size)
    return [{"id": f"search-c{corpus_seed}-{split}-{seed}-{i}", "question": q["question"],
             "answer": q["answer"], "task": "search",
             "metadata": {"corpus_seed": corpus_seed, "n_entities": n_entities,
                          "hops": q["hops"], "supporting_doc_ids": q["supporting_doc_ids"]}}
            for i, q in enumerate(chosen)]


# -- the tool -------------------------------------------------------------------------


class SearchTool:
    """`search(query)`: the top-k corpus documents by BM25, one per line."""

    name = "search"
    description = "Search the knowledge base. Returns the most relevant documents, one per line."
    parameters: ClassVar[dict[str, Any]] = {"type": "object",
                  "properties": {"query": {"type": "string",
                                           "description": "Words to search for, such as a name."}},
                  "required": ["query"]}
    deterministic = True
    _cache: ClassVar[dict[tuple[int, int], SearchTool]] = {}

    def __init__(self, corpus: list[dict[str, Any]], k: int = 3) -> None:
        import bm25s  # imported here so loading items does not need it

        self.texts = [d["text"] for d in corpus]
        self.k = k
        self._tokenizer = bm25s.tokenization.Tokenizer(stopwords="en")
        self._index = bm25s.BM25()
        self._index.index(self._tokenizer.tokenize(self.texts, show_progress=False),
                          show_progress=False)

    @classmethod
    def for_corpus(cls, corpus_seed: int, n_entities: int) -> SearchTool:
        """The tool for one corpus, built once per process."""
        key = (corpus_seed, n_entities)
        if key not in cls._cache:
            cls._cache[key] = cls(make_corpus(corpus_seed, n_entities))
        return cls._cache[key]

    @classmethod
    def for_item(cls, item: dict[str, Any]) -> SearchTool:
        """The tool for the corpus an item's question is about."""
        meta = item["metadata"]
        return cls.for_corpus(meta["corpus_seed"], meta["n_entities"])

    def search(self, query: str) -> list[str]:
        """The texts of the top-k documents for `query` (fewer if fewer share a word with it)."""
        ids = self._tokenizer.tokenize([query], update_vocab=False, return_as="ids",
                                       show_progress=False)
        if not ids[0]:  # no query word occurs in the corpus
            return []
        docs, scores = self._index.retrieve(ids, k=min(self.k, len(self.texts)),
                                            show_progress=False, n_threads=0)
        return [self.texts[d] for d, s in zip(docs[0], scores[0]) if s > 0]

    async def __call__(self, args: dict[str, Any]) -> str:
        """The search result as the model sees it. A malformed call gets a message back,
        since it is the policy's mistake to learn from, not a bug."""
        query = args.get("query")
        if isinstance(query, dict):  # SmolLM2 often nests it: {"query": {"name": "..."}}
            query = " ".join(v for v in query.values() if isinstance(v, str))
        if not isinstance(query, str) or not query.strip():
            return 'Error: search needs {"query": "<words to search for>"}.'
        return "\n".join(self.search(query)) or "No results."


# -- scoring --------------------------------------------------------------------------

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def normalize(text: str) -> str:
    """Lowercase, punctuation dropped, whitespace collapsed, a leading "the" dropped."""
    text = re.sub(r"[^\w\s]", " ", text.lower())
    text = " ".join(text.split())
    return text.removeprefix("the ")


def extract_answer(completion: str) -> str | None:
    """The text of the last <answer>...</answer> in `completion`, or None."""
    found = _ANSWER.findall(completion)
    return found[-1] if found else None


def score_answer(completion: str, item: dict[str, Any]) -> float:
    """1.0 if the last <answer> tag holds the gold answer (after `normalize`), else 0.0."""
    answer = extract_answer(completion)
    return float(answer is not None and normalize(answer) == normalize(item["answer"]))


# -- prompt ---------------------------------------------------------------------------

# Two worked conversations as chat turns, each with a lead-in before its call. With the
# example written inline in the system text instead, SmolLM2-135M searched in 15% of greedy
# first turns but never tagged its answer (0% before and after 10 steps of RL); with these
# turns the held-out reward went 0.000 -> 0.328 in 12 steps (examples/agents/README.md).
SYSTEM_PROMPT = ("You do not know anything about the people, towns and things you are asked "
                 "about: always use the search tool, then copy the answer into "
                 "<answer></answer> tags.")


# What each relation's object is: what a result gives, and what a question asks for.
OBJECT_KIND = {"born_in": "town", "located_in": "province", "invented_by": "person",
               "founded_by": "person"}


def asks_for(kind: str) -> str:
    """The sentence that opens every turn: what the question asks for."""
    return f"The question asks for a {kind}."


def found(kind: str, entity: str, entity_kind: str) -> str:
    """A turn after a result: what the question asks for, what the result names, and the
    decision right after both: answer if they are the same kind, else search the entity."""
    if entity_kind == kind:
        return f"{asks_for(kind)} {entity} is a {kind}, so the answer is {entity}.\n" \
               f"<answer>{entity}</answer>"
    return f"{asks_for(kind)} {entity} is a {entity_kind}, so I will search for {entity}."


def _worked_example(question: str, kind: str, query: str, result: str,
                    answer: str) -> list[dict[str, Any]]:
    """One episode done right: question, search call, its result, the copied answer."""
    call = {"id": "call_0", "type": "function",
            "function": {"name": "search", "arguments": json.dumps({"query": query})}}
    return [{"role": "user", "content": question},
            {"role": "assistant", "content": f"{asks_for(kind)} I will search for {query}.",
             "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": result},
            {"role": "assistant", "content": found(kind, answer, kind)}]


# Names the default corpus (seed 0, 200 people) does not contain (a test checks), so an
# example never gives away a real answer. Every turn says what the question asks for and,
# after a result, what kind of thing it names: whether to answer or to search again is
# then decided by two words just written, not by the question many tokens back (RL moved
# a decision made from the question alone for every question at once; README).
FEW_SHOT: list[dict[str, Any]] = (
    _worked_example("In which town was Orla Fennick born?", "town", "Orla Fennick",
                    "Orla Fennick was born in the town of Brask.", "Brask")
    + _worked_example("Who invented the Dovel Compass?", "person", "Dovel Compass",
                      "The Dovel Compass is a device that was invented by Tamsin Vey.",
                      "Tamsin Vey"))
