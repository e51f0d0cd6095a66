"""The `openai` package streaming through br-shim to the emulated engine: the client sees an
ordinary OpenAI-compatible stream (the usage the shim asks the engine for is stripped), and the
shim counts the tokens it forwarded."""

import re
import urllib.request

import openai
import pytest

MODEL = "br-emu"
TOKEN = " tok"


@pytest.fixture(scope="module")
def client(shim_url):
    return openai.OpenAI(base_url=f"{shim_url}/v1", api_key="unused", max_retries=0, timeout=60)


def tokens_total(admin_url):
    with urllib.request.urlopen(f"{admin_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    # one series: this shim serves one rank (labelled with its group and worker)
    m = re.search(r"^balanceroute_shim_tokens_total(?:\{[^}]*\})? (\d+)", text, re.M)
    assert m, text
    return int(m.group(1))


def test_streams_a_chat_completion(client, shim_admin_url):
    before = tokens_total(shim_admin_url)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=12,
        stream=True,
        extra_headers={"X-Request-Id": "py-chat-stream-1"},
    )
    text, finish, chunks = "", None, 0
    for chunk in stream:
        chunks += 1
        assert chunk.id == "chatcmpl-py-chat-stream-1"
        assert chunk.usage is None, "usage the client did not ask for must not reach it"
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert text == TOKEN * 12
    assert finish == "length"
    assert chunks == 13  # the role chunk, then one chunk per token
    assert tokens_total(shim_admin_url) - before == 12


def test_stream_with_usage_gets_exactly_the_final_usage_chunk(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "abcdefgh"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.completion_tokens == 5
    assert last.usage.prompt_tokens > 0


def test_completion_without_streaming(client):
    resp = client.completions.create(model=MODEL, prompt="hello", max_tokens=4)
    assert resp.choices[0].text == TOKEN * 4
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 4


def test_models_pass_through(client):
    assert MODEL in [m.id for m in client.models.list()]
