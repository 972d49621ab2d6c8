"""The search-agent task: its generated corpus, questions, BM25 tool and answer scoring."""

import asyncio
import json

import pytest

from asyncrl.agents.search import (
    FEW_SHOT,
    SYSTEM_PROMPT,
    SearchTool,
    all_questions,
    make_corpus,
    score_answer,
    search_items,
)
from asyncrl.openai.tool_calls import hermes_messages

# n_entities=200 people -> 40 towns, 8 provinces, 100 inventions, 100 firms:
# 200 birth + 40 location + 100 invention + 100 founding docs.
N_DOCS = 440


@pytest.fixture(scope="module")
def corpus():
    return make_corpus(0, 200)


def _docs(corpus):
    return {d["id"]: d for d in corpus}


def test_same_seed_gives_the_same_corpus_and_another_seed_a_different_one(corpus):
    assert make_corpus(0, 200) == corpus
    assert len(corpus) == N_DOCS
    assert [d["text"] for d in make_corpus(1, 200)] != [d["text"] for d in corpus]


def test_doc_ids_and_texts_are_unique(corpus):
    assert len({d["id"] for d in corpus}) == N_DOCS
    assert len({d["text"] for d in corpus}) == N_DOCS


def test_one_hop_answer_is_in_its_single_supporting_doc(corpus):
    docs = _docs(corpus)
    questions = all_questions(corpus, [1])
    assert len(questions) == N_DOCS  # one question per fact
    for q in questions:
        (doc_id,) = q["supporting_doc_ids"]
        assert q["answer"] in docs[doc_id]["text"]


def test_two_hop_answer_is_only_in_the_second_doc(corpus):
    docs = _docs(corpus)
    questions = all_questions(corpus, [2])
    # 200 "province of a person's birth" + 100 inventors' towns + 100 founders' towns
    assert len(questions) == 400
    for q in questions:
        first, second = (docs[i] for i in q["supporting_doc_ids"])
        assert first["subject"] in q["question"]
        assert q["answer"] not in first["text"]
        assert q["answer"] in second["text"]
        assert first["object"] == second["subject"]  # the first lookup names the second


def test_items_have_the_dataset_item_shape():
    (item,) = search_items(1, seed=0, hops=[1, 2])
    assert item["task"] == "search"
    assert set(item) == {"id", "question", "answer", "task", "metadata"}
    assert set(item["metadata"]) == {"corpus_seed", "n_entities", "hops", "supporting_doc_ids"}
    assert search_items(5, seed=3) == search_items(5, seed=3)


def test_train_and_valid_questions_are_disjoint():
    # 440 one-hop questions: 103 (23%; 20% in expectation, by hash) held out, 337 for training.
    train = search_items(337, seed=0, split="train")
    valid = search_items(103, seed=1, split="valid")
    assert len({i["question"] for i in train}) == 337
    assert not {i["question"] for i in train} & {i["question"] for i in valid}
    other_seed = search_items(40, seed=7, split="valid")
    assert {i["question"] for i in other_seed} <= {i["question"] for i in valid}


def test_a_question_is_held_out_or_not_whatever_hops_are_asked_for():
    def questions(hops, split, size):
        return {i["question"] for i in search_items(size, seed=0, hops=hops, split=split)}

    mixed_valid, mixed_train = questions([1, 2], "valid", 185), questions([1, 2], "train", 655)
    assert questions([1], "valid", 103) | questions([2], "valid", 82) == mixed_valid
    assert questions([1], "train", 337) | questions([2], "train", 318) == mixed_train
    assert not mixed_valid & mixed_train


def test_asking_for_more_items_than_the_split_holds_is_an_error():
    with pytest.raises(ValueError, match="has 103"):
        search_items(104, seed=0, split="valid")
    with pytest.raises(ValueError, match="split"):
        search_items(1, seed=0, split="test")


def test_bm25_ranks_the_supporting_doc_first_for_the_entity_name(corpus):
    # The name alone matches several docs (a person's birth, invention and firm docs), and
    # the supporting one is the shortest, so BM25 ranks it first in every one of the 440.
    docs = _docs(corpus)
    tool = SearchTool.for_corpus(0, 200)
    firsts = [tool.search(docs[q["supporting_doc_ids"][0]]["subject"])[0] == docs[q["supporting_doc_ids"][0]]["text"]
              for q in all_questions(corpus, [1])]
    assert sum(firsts) == N_DOCS


def test_bm25_ranks_the_supporting_doc_first_for_the_question_itself(corpus):
    docs = _docs(corpus)
    tool = SearchTool.for_corpus(0, 200)
    hits = sum(tool.search(q["question"])[0] == docs[q["supporting_doc_ids"][0]]["text"]
               for q in all_questions(corpus, [1]))
    assert hits == N_DOCS


def test_tool_is_built_once_per_corpus():
    item = search_items(1, seed=0)[0]
    assert SearchTool.for_item(item) is SearchTool.for_corpus(0, 200)
    assert SearchTool.for_corpus(1, 200) is not SearchTool.for_corpus(0, 200)


def test_tool_output_is_the_top_three_doc_texts_one_per_line(corpus):
    texts = {d["text"] for d in corpus}
    out = asyncio.run(SearchTool.for_corpus(0, 200)({"query": corpus[0]["subject"]}))
    lines = out.split("\n")
    assert len(lines) == 3
    assert all(line in texts for line in lines)
    assert lines[0] == corpus[0]["text"]


def test_tool_answers_an_unknown_query_and_a_malformed_call_in_text():
    tool = SearchTool.for_corpus(0, 200)
    assert asyncio.run(tool({"query": "zzzq qqqz"})) == "No results."
    assert asyncio.run(tool({"q": "x"})).startswith("Error:")
    assert asyncio.run(tool({"query": 3})).startswith("Error:")


def test_tool_accepts_a_query_nested_in_an_object(corpus):
    tool = SearchTool.for_corpus(0, 200)
    name = corpus[0]["subject"]
    assert asyncio.run(tool({"query": {"name": name}})) == asyncio.run(tool({"query": name}))


def test_tool_fits_the_agents_tool_spec():
    from asyncrl.agents.tools import tool_spec

    spec = tool_spec(SearchTool.for_corpus(0, 200))
    assert spec["function"]["name"] == "search"
    assert spec["function"]["parameters"]["required"] == ["query"]


def test_tool_declares_a_query_parameter():
    assert SearchTool.name == "search" and SearchTool.deterministic
    assert SearchTool.parameters["required"] == ["query"]
    assert SearchTool.parameters["properties"]["query"]["type"] == "string"


@pytest.mark.parametrize(("completion", "score"), [
    ("<answer>Drennick</answer>", 1.0),
    ("<answer> drennick. </answer>", 1.0),
    ("I think <ANSWER>Drennick</ANSWER>", 1.0),
    ("<answer>Ostavel</answer> no wait <answer>Drennick</answer>", 1.0),  # the last tag counts
    ("<answer>Drennick</answer> no wait <answer>Ostavel</answer>", 0.0),
    ("<answer>the town of Drennick</answer>", 0.0),
    ("Drennick", 0.0),  # no tag, no credit
    ("<answer>Drennick", 0.0),
    ("", 0.0),
])
def test_score_answer_reads_the_last_answer_tag(completion, score):
    assert score_answer(completion, {"answer": "Drennick"}) == score


def test_score_answer_normalises_case_whitespace_and_punctuation():
    item = {"answer": "Velmora Quist"}
    assert score_answer("<answer>velmora   quist!</answer>", item) == 1.0
    assert score_answer("<answer>Velmora\nQuist</answer>", item) == 1.0
    assert score_answer("<answer>Velmora</answer>", item) == 0.0


def test_worked_examples_are_well_formed_and_about_no_corpus_entity(corpus):
    calls = [c for m in FEW_SHOT for c in m.get("tool_calls", [])]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == \
        [{"query": "Orla Fennick"}, {"query": "Dovel Compass"}]
    answers = [m["content"] for m in FEW_SHOT if m["role"] == "assistant" and "<answer>" in m["content"]]
    assert [score_answer(a, {"answer": g}) for a, g in zip(answers, ["Brask", "Tamsin Vey"])] == [1.0, 1.0]
    names = {d["subject"] for d in corpus} | {d["object"] for d in corpus}
    text = SYSTEM_PROMPT + json.dumps(FEW_SHOT)
    assert not any(name in text for name in names)
    rendered = hermes_messages(FEW_SHOT, None, None)  # tool turns become plain text turns
    assert sum("<tool_call>" in m["content"] for m in rendered) == 2




def test_warm_start_episodes_search_the_subject_and_copy_the_answer(tmp_path):
    import importlib.util
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "examples/agents/search/make_sft_data.py"
    spec = importlib.util.spec_from_file_location("make_sft_data", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "sft.jsonl"
    argv, sys.argv = sys.argv, ["make_sft_data.py", "--out", str(out), "--size", "8"]
    try:
        module.main()
    finally:
        sys.argv = argv
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    items = search_items(size=8, seed=0, hops=[1], split="train")
    assert len(rows) == 8
    for row, item in zip(rows, items):
        *_, question, call, result, answer = row["messages"]
        assert question == {"role": "user", "content": item["question"]}
        assert call["role"] == "assistant" and '"name": "search"' in call["content"]
        # The supporting document comes back first, and the answer copies its object.
        assert result["content"].startswith("<tool_response>\n")
        assert item["answer"] in result["content"]
        assert answer["content"].endswith(f"<answer>{item['answer']}</answer>")


def test_two_hop_warm_start_episodes_search_twice_then_answer(tmp_path):
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "examples/agents/search/make_sft_data.py"
    spec = importlib.util.spec_from_file_location("make_sft_data", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    items = module.worked_items(8, seed=0, corpus_seed=0, n_entities=200, hops=[1, 2],
                                two_hop_fraction=0.5)
    assert sorted(i["metadata"]["hops"] for i in items) == [1] * 4 + [2] * 4
    corpus = {d["id"]: d for d in make_corpus(0, 200)}
    # What each template asks for, written out by hand.
    kinds = {"In which town": "town", "In which province": "province", "Who ": "person"}
    for item in items:
        turns = module.episode(item, corpus)["messages"][-2 * item["metadata"]["hops"] - 2:]
        question, *middle, answer = turns
        assert question == {"role": "user", "content": item["question"]}
        chain = [corpus[d] for d in item["metadata"]["supporting_doc_ids"]]
        kind = next(k for prefix, k in kinds.items() if item["question"].startswith(prefix))
        for (call, result), doc in zip(zip(middle[::2], middle[1::2]), chain):
            # Each call searches the next entity of the chain: the question's subject, then
            # the entity the first result named; each result holds its supporting document.
            assert f'"query": "{doc["subject"]}"' in call["content"]
            assert doc["object"] in result["content"]
            # Every turn says what the question asks for.
            assert call["content"].startswith(f"The question asks for a {kind}. ")
        if item["metadata"]["hops"] == 2:  # the first result names another kind: search it
            middle_kind = {"born_in": "town", "invented_by": "person",
                           "founded_by": "person"}[chain[0]["relation"]]
            assert middle_kind != kind
            assert middle[2]["content"].startswith(
                f"The question asks for a {kind}. {chain[0]['object']} is a {middle_kind}, "
                f"so I will search for {chain[0]['object']}.")
        assert answer["content"] == (
            f"The question asks for a {kind}. {item['answer']} is a {kind}, so the answer is "
            f"{item['answer']}.\n<answer>{item['answer']}</answer>")
