"""Generation across a weight update on servers whose pause aborts (vLLM's way), with fakes."""

import asyncio

from fake_vllm import FakeVLLMServers

from asyncrl.api import GenerationRequest, SamplingParams
from asyncrl.inference.client.vllm import VLLMClient


def test_interrupted_request_resumes_on_its_server_with_tokens_of_both_versions(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    fakes = FakeVLLMServers(2, token_s=0.05)
    client = VLLMClient(fakes.addresses, update_weights_timeout=5)
    prompt = [7, 8, 9]

    async def go():
        long = asyncio.ensure_future(client.agenerate(GenerationRequest(
            input_ids=prompt, sampling=SamplingParams(max_new_tokens=30), rid="long")))
        other = await client.agenerate(GenerationRequest(  # busies the other server
            input_ids=[5], sampling=SamplingParams(max_new_tokens=5), rid="other"))
        await asyncio.sleep(0.1)  # "long" is well into its 1.5 s of tokens
        await client.update_weights_from_disk(str(tmp_path), 1)
        return await long, other

    r, other = asyncio.run(go())
    asyncio.run(client.close())
    pieces = [(srv, body) for srv, path, body in fakes.calls if path == "/v1/completions"
              and body["prompt"][:3] == prompt]
    assert len(pieces) == 2 and pieces[0][0] == pieces[1][0]  # resubmitted to its own server
    n_old = len(pieces[1][1]["prompt"]) - len(prompt)
    assert 0 < n_old < 30
    # the second piece continues the first: prompt + tokens so far, for the rest of the budget
    assert pieces[1][1]["prompt"] == prompt + r.output_ids[:n_old]
    assert pieces[1][1]["max_tokens"] == 30 - n_old
    assert r.output_ids == list(range(3, 33))  # stitched without a gap or a repeat
    assert r.output_versions == [0] * n_old + [1] * (30 - n_old)
    assert r.output_logprobs == [-1.0] * n_old + [-2.0] * (30 - n_old)
    assert r.stop_reason.value == "length"
    assert other.output_versions == [0] * 5
    # both servers were paused (aborting), reloaded, versioned and resumed, in that order
    for i in (0, 1):
        steps = [p for srv, p, _ in fakes.calls if srv == i and p != "/v1/completions"]
        assert steps == ["/pause", "/collective_rpc", "/update_weight_version", "/resume"]
    assert fakes.versions == [1, 1]


def test_server_failing_health_leaves_routing_and_returns_resynced(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    fakes = FakeVLLMServers(2, token_s=0.001)
    client = VLLMClient(fakes.addresses, update_weights_timeout=5)

    async def go():
        fakes.healthy[1] = False
        assert await client.check_servers() == [fakes.addresses[0]]
        await client.update_weights_from_disk(str(tmp_path), 4)  # server 0 only
        while_down = [await client.agenerate(GenerationRequest(
            input_ids=[1], sampling=SamplingParams(max_new_tokens=2))) for _ in range(3)]
        fakes.versions[1] = 0  # it comes back restarted, with the base weights
        fakes.healthy[1] = True
        live = await client.check_servers()
        return while_down, live

    while_down, live = asyncio.run(go())
    asyncio.run(client.close())
    assert live == fakes.addresses and fakes.versions == [4, 4]
    assert all(r.output_versions == [4, 4] for r in while_down)
    served = [srv for srv, path, _ in fakes.calls if path == "/v1/completions"]
    assert served == [0, 0, 0]  # nothing went to the failed server
    resync = [p for srv, p, _ in fakes.calls if srv == 1 and p not in ("/health",)]
    assert resync == ["/weight_info", "/pause", "/collective_rpc", "/update_weight_version",
                      "/resume"]  # read its version, then loaded the current one


def test_lora_versions_load_as_adapters_and_each_piece_names_its_own(tmp_path):
    folders = []
    for v in (1, 2, 3):
        folder = tmp_path / f"a{v}"
        folder.mkdir()
        (folder / "adapter_config.json").write_text("{}")
        (folder / "adapter_model.safetensors").write_bytes(b"")
        folders.append(str(folder))
    fakes = FakeVLLMServers(1, token_s=0.05)
    client = VLLMClient(fakes.addresses, update_weights_timeout=5)
    prompt = [7, 8, 9]

    async def go():
        long = asyncio.ensure_future(client.agenerate(GenerationRequest(
            input_ids=prompt, sampling=SamplingParams(max_new_tokens=20), rid="long")))
        await asyncio.sleep(0.2)
        await client.update_weights_from_disk(folders[0], 1)  # mid-generation
        r = await long
        await client.update_weights_from_disk(folders[1], 2)
        await client.update_weights_from_disk(folders[2], 3)
        last = await client.agenerate(GenerationRequest(
            input_ids=[5], sampling=SamplingParams(max_new_tokens=2)))
        return r, last

    r, last = asyncio.run(go())
    asyncio.run(client.close())
    pieces = [body for _, path, body in fakes.calls if path == "/v1/completions"]
    # the first piece ran on the base (no adapter named), its continuation under v1's
    assert "model" not in pieces[0] and pieces[1]["model"] == "asyncrl-lora-v1-1"
    assert pieces[2]["model"] == "asyncrl-lora-v3-3"
    n_old = r.output_versions.count(0)
    assert 0 < n_old < 20 and r.output_versions == [0] * n_old + [1] * (20 - n_old)
    assert last.output_versions == [3, 3]
    loads = [(p, b) for _, p, b in fakes.calls if "lora" in p]
    assert loads == [
        ("/v1/load_lora_adapter", {"lora_name": "asyncrl-lora-v1-1", "lora_path": folders[0]}),
        ("/v1/load_lora_adapter", {"lora_name": "asyncrl-lora-v2-2", "lora_path": folders[1]}),
        ("/v1/load_lora_adapter", {"lora_name": "asyncrl-lora-v3-3", "lora_path": folders[2]}),
        ("/v1/unload_lora_adapter", {"lora_name": "asyncrl-lora-v1-1"})]
    # the one before the newest stays for a piece sent just before the update
    assert fakes.adapters[0] == {"asyncrl-lora-v2-2": folders[1], "asyncrl-lora-v3-3": folders[2]}
    # the update's steps, in order: the version label follows the load, then the resume
    steps = [p for _, p, _ in fakes.calls if p not in ("/v1/completions", "/health",
                                                       "/weight_info")]
    assert steps[:4] == ["/pause", "/v1/load_lora_adapter", "/update_weight_version", "/resume"]
