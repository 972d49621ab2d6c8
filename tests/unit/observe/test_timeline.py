"""The run timeline (observe/timeline.py): spans recorded by the trainer's step sections and
by the inference client's routing, busy shares worked out by hand, and the picture."""

import asyncio
import json

import pytest

from asyncrl.api.types import GenerationRequest, GenerationResponse
from asyncrl.inference.client.base import HTTPInferenceClient
from asyncrl.observe.timeline import Timeline, busy_shares, plot_timeline, read_timeline
from asyncrl.observe.timing import StepTimer


def test_busy_shares_merge_overlaps_and_leave_waits_out():
    spans = [{"lane": "trainer", "kind": "wait", "t0": 0.0, "t1": 2.0},
             {"lane": "trainer", "kind": "train", "t0": 2.0, "t1": 8.0},
             {"lane": "trainer", "kind": "publish", "t0": 8.0, "t1": 10.0},
             {"lane": "server 0", "kind": "generate", "t0": 0.0, "t1": 3.0},
             {"lane": "server 0", "kind": "generate", "t0": 1.0, "t1": 4.0},  # overlaps
             {"lane": "server 0", "kind": "load weights", "t0": 8.0, "t1": 9.0}]
    # trainer: 6 + 2 of 10 s; server: [0, 4] and [8, 9] = 5 of 10 s
    assert busy_shares(spans) == {"trainer": 0.8, "server 0": 0.5}


def test_step_sections_and_a_torn_line_become_spans(tmp_path):
    timeline = Timeline(tmp_path / "timeline.jsonl")
    timer = StepTimer(timeline, kinds={"train_s": "train"})
    with timer("train_s"):
        pass
    with timer("other_s"):  # not drawn
        pass
    with timeline.span("trainer", "eval"):
        pass
    timeline.begin("server 0", "generate")
    timeline.begin("server 0", "generate")  # already open: ignored
    timeline.end("server 0", "generate")
    timeline.end("server 0", "generate")  # nothing open: nothing written
    with open(timeline.path, "a") as f:
        f.write('{"lane": "trai')  # a run killed mid-write
    spans = read_timeline(timeline.path)
    assert [(s["lane"], s["kind"]) for s in spans] == [
        ("trainer", "train"), ("trainer", "eval"), ("server 0", "generate")]
    assert all(s["t1"] >= s["t0"] for s in spans) and set(timer.seconds) == {"train_s", "other_s"}
    png = plot_timeline(timeline.path, tmp_path / "timeline.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _SlowClient(HTTPInferenceClient):
    """Answers after a short sleep; weight loads also sleep."""

    async def _generate_on(self, idx, req):
        await asyncio.sleep(0.05)
        return GenerationResponse(rid=req.rid, input_ids=req.input_ids, output_ids=[1], output_logprobs=[0.0],
                                  output_versions=[0], stop_reason="length")

    async def _update_one(self, idx, path, version):
        await asyncio.sleep(0.02)


def test_the_client_draws_a_generate_span_per_busy_period_and_a_span_per_load(tmp_path):
    client = _SlowClient(["http://127.0.0.1:1"])
    client.timeline = Timeline(tmp_path / "timeline.jsonl")

    async def run():
        # three overlapping requests: one busy period; then a load; then one more request
        await asyncio.gather(*(client._route(GenerationRequest(input_ids=[1])) for _ in range(3)))
        await client._update_server(0, "weights", 1)
        await client._route(GenerationRequest(input_ids=[1]))

    asyncio.run(run())
    spans = [json.loads(line) for line in client.timeline.path.read_text().splitlines()]
    assert [(s["lane"], s["kind"]) for s in spans] == [
        ("server 0", "generate"), ("server 0", "load weights"), ("server 0", "generate")]
    assert spans[0]["t1"] - spans[0]["t0"] == pytest.approx(0.05, abs=0.04)
