"""The shared end-to-end suite against the GPU engine on the tiny synthetic checkpoint."""

from __future__ import annotations

import random
import re

import pytest

from tests.server.e2e_suite import *  # noqa: F403 - the shared tests run against this module's fixtures
from tests.server.servers import Server


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    s = Server(
        ["serve", "--engine", "exl3", "--mode", "exact", "-m", str(tiny_checkpoint), "-cs", "16384", "--max-batch-size", "4", "-ambs", "4",
         "-chunk_size", "2048", "--sse-keepalive-s", "0.2"]
    ).wait_ready(timeout=600)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def concurrency():
    return 4


def test_server_reports_the_checkpoint(server):
    code, info = server.get("/server_info")
    assert code == 200 and info["loaded_model"]["architecture"] == "Glm5NextForConditionalGeneration"
    assert info["loaded_model"]["chat_template"] == "checkpoint tokenizer_config.json"
    assert info["loaded_model"]["decode_slots"] == 4 and info["load_seconds"] > 0


def test_tool_request_round_trip(server):
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
    code, r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "time?"}], "tools": tools, "max_tokens": 24})
    assert code == 200 and r["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


def test_thinking_off_prompt_has_an_empty_think_block(server):
    code, r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                                                   "chat_template_kwargs": {"enable_thinking": False}, "temperature": 0})
    assert code == 200 and r["choices"][0]["message"]["reasoning_content"] is None


def test_a_repeated_prompt_reports_the_tokens_it_took_from_the_prefix_cache(server):
    """exllamav3 reuses whole 256-token pages of a prompt it has seen, up to the last page boundary before the
    prompt's final token (that token is always fed). On this recurrent model the reuse also needs a stashed
    recurrent state there, and the first run stashes one at exactly that boundary (job.py, ``recurrent_last_page``)."""
    from glm53.engine.exl3.load import page_size

    page = page_size()
    rng = random.Random()  # fresh ids every run: nothing before this test shares a page with them
    ids = [rng.randrange(1000, 150000) for _ in range(1000)]
    expected = (len(ids) - 1) // page * page  # 768
    before = server.get("/stats")[1]["scheduler"]
    body = {"prompt": ids, "max_tokens": 4, "temperature": 0}
    code, first = server.post("/v1/completions", body)
    assert code == 200 and first["usage"]["prompt_tokens"] == len(ids)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    code, second = server.post("/v1/completions", body)
    assert code == 200 and second["usage"]["prompt_tokens_details"] == {"cached_tokens": expected}
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    code, third = server.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert code == 200 and third["meta_info"]["cached_tokens"] == expected
    after = server.get("/stats")[1]["scheduler"]
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 2 * expected
    assert after["prefix_cache_misses"] - before["prefix_cache_misses"] == 3 * len(ids) - 2 * expected


def test_server_info_names_the_gpu(server):
    import torch

    code, info = server.get("/server_info")
    gpu = info["gpu"]
    props = torch.cuda.get_device_properties(0)  # the server's device: it sees the same CUDA_VISIBLE_DEVICES
    assert code == 200 and gpu["index"] == 0 and gpu["name"] == props.name
    assert gpu["total_memory_gb"] == round(props.total_memory / 1e9, 2) and gpu["total_memory_gb"] > 1
    assert gpu["compute_capability"] == f"{props.major}.{props.minor}" and gpu["multiprocessors"] == props.multi_processor_count
    assert re.fullmatch(r"\d+\.\d+(\.\d+)*", gpu["driver_version"]), gpu
    assert re.fullmatch(r"\d+\.\d+", gpu["cuda_driver_version"]) and gpu["cuda_runtime_version"] == torch.version.cuda
