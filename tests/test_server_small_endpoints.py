"""Small things a client reaches for (issue 23 item 4): Anthropic's token counting, the
favicon, and a stream that ended normally logged as such (SPEC O1: logs say what happened)."""

from __future__ import annotations

import logging
import time
from typing import Any

import anthropic
import httpx
import openai
import pytest

WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


@pytest.fixture
def claude(server_live: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server_live.url, api_key="unused", max_retries=0)


@pytest.mark.parametrize("extra", [{}, {"system": "You are terse."}])
def test_count_tokens_equals_the_prompt_messages_create_processes(
        claude: anthropic.Anthropic, server_live: Any, extra: dict[str, Any]) -> None:
    """The count is the prompt /v1/messages builds from the same system, messages and tools:
    what its usage reports (input + cache-read tokens)."""
    messages: list[Any] = [{"role": "user", "content": "Hello there, how are you?"},
                           {"role": "assistant", "content": "Fine."},
                           {"role": "user", "content": "Tell me about the sea."}]
    counted = claude.messages.count_tokens(model=server_live_model(server_live),
                                           messages=messages, **extra)
    made = claude.messages.create(model=server_live_model(server_live), max_tokens=1,
                                  messages=messages, **extra)
    used = made.usage.input_tokens + (made.usage.cache_read_input_tokens or 0)
    assert counted.input_tokens == used > 0


def test_count_tokens_counts_the_tool_prompt(claude: anthropic.Anthropic,
                                             server_live: Any) -> None:
    """With tools the rendered prompt carries their schemas: the count is the one the
    messages call meets (on this 512-token model it is over the context: the count is then
    the create's own refusal, naming the same number, as Anthropic's "prompt is too long"; L5)."""
    model = server_live_model(server_live)
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    plain = claude.messages.count_tokens(model=model, messages=messages).input_tokens
    try:
        counted = claude.messages.count_tokens(model=model, messages=messages,
                                               tools=[WEATHER]).input_tokens  # type: ignore[list-item]
    except anthropic.BadRequestError as refused:
        with pytest.raises(anthropic.BadRequestError) as made_err:
            claude.messages.create(model=model, max_tokens=1, messages=messages,
                                   tools=[WEATHER])  # type: ignore[list-item]
        assert refused.body == {**made_err.value.body,  # type: ignore[dict-item]
                                "request_id": refused.body["request_id"]}  # type: ignore[index]
        assert int(refused.message.split(" has ")[1].split()[0]) > plain
        return
    assert counted > plain
    made = claude.messages.create(model=model, max_tokens=1, messages=messages,
                                  tools=[WEATHER])  # type: ignore[list-item]
    assert made.usage.input_tokens + (made.usage.cache_read_input_tokens or 0) == counted


def test_count_tokens_refuses_bad_input_in_anthropic_shape(claude: anthropic.Anthropic,
                                                           server_live: Any) -> None:
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.count_tokens(model="no-such-model",
                                     messages=[{"role": "user", "content": "hi"}])
    r = httpx.post(f"{server_live.url}/v1/messages/count_tokens",
                   json={"model": server_live_model(server_live), "messages": []})
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_favicon_is_served(server_live: Any) -> None:
    r = httpx.get(f"{server_live.url}/favicon.ico")
    assert r.status_code == 200 and r.headers["content-type"].startswith("image/svg+xml")
    assert r.content.lstrip().startswith(b"<svg")


def test_o1_a_stream_read_to_its_end_is_not_logged_as_a_lost_client(
        claude: anthropic.Anthropic, server_live: Any, server_settle: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    """The anthropic SDK closes the connection at message_stop, before the server's last
    write: that is a normal end, not "client gone". A client that really leaves mid-stream
    still is logged (the control)."""
    model = server_live_model(server_live)
    with caplog.at_level(logging.INFO, logger="coda.server"):
        for _ in range(4):
            with claude.messages.stream(model=model, max_tokens=12,
                                        messages=[{"role": "user", "content": "Hi"}]) as s:
                s.get_final_message()
        oai = openai.OpenAI(base_url=server_live.url + "/v1", api_key="unused", max_retries=0)
        for _ in range(2):
            list(oai.chat.completions.create(model=model, max_tokens=12, stream=True,
                                             messages=[{"role": "user", "content": "Hi"}]))
        server_settle()
        assert not [r for r in caplog.records if "gone" in r.getMessage()]
        with httpx.stream("POST", f"{server_live.url}/v1/messages", json={
                "model": model, "max_tokens": 400, "stream": True,
                "messages": [{"role": "user", "content": "Write a long story."}],
                "min_tokens": 400}) as resp:
            next(resp.iter_lines())  # NOTE: one line, then leave mid-stream
        end = time.monotonic() + 20
        while time.monotonic() < end and not any("gone" in r.getMessage()
                                                 for r in caplog.records):
            time.sleep(0.05)
    assert [r for r in caplog.records if "gone" in r.getMessage()]


def server_live_model(server_live: Any) -> str:
    return str(httpx.get(f"{server_live.url}/v1/models").json()["data"][0]["id"])

