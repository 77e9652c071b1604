"""Anthropic's message threads (``thread``: server-held conversation state) on a server that
holds none (SPEC P1).

The SDK's ``client.beta.messages.tool_runner(...)`` sends ``thread: {"type": "create"}`` on
its first turn. Coda answered "thread: Extra inputs are not permitted", so the runner raised
on its first request. A server that cannot thread a request says so with
``error.details.error_code == "thread_unsupported_request"``; the runner then sends that turn
and every later one with the full history and no ``thread``. Coda now answers that 400 (it
stores no conversation), so the runner works; ``thread: null`` asks for nothing and is served.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import anthropic
import pytest
from anthropic import beta_tool

from tests.conftest import smollm_anthropic
from tests.test_server_openai import MODEL

_MSGS: Any = [{"role": "user", "content": "weather?"}]


def _client(server_live: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server_live.url, api_key="k", max_retries=0)


@pytest.mark.parametrize("thread", [{"type": "create"},
                                    {"type": "continue", "previous_message_id": "msg_1"}])
def test_p1_thread_is_a_400_the_sdk_reads_as_unthreadable(server_live: Any,
                                                          thread: dict[str, Any]) -> None:
    """P1: a 400 naming ``thread`` whose details carry the SDK's
    ``thread_unsupported_request`` code (not "Extra inputs are not permitted")."""
    with pytest.raises(anthropic.BadRequestError) as exc:
        _client(server_live).beta.messages.create(model=MODEL, max_tokens=4, messages=_MSGS,
                                                  extra_body={"thread": thread})
    body: Any = exc.value.body
    assert body["error"]["type"] == "invalid_request_error", body
    assert body["error"]["message"].startswith("thread: "), body
    assert "Extra inputs" not in body["error"]["message"], body
    assert body["error"]["details"] == {"error_code": "thread_unsupported_request",
                                        "unsupported": ["thread"]}, body


def test_p1_thread_null_is_served(server_live: Any) -> None:
    """P1: ``thread: null`` asks for nothing."""
    out = _client(server_live).messages.create(model=MODEL, max_tokens=4, messages=_MSGS,
                                               extra_body={"thread": None})
    assert out.stop_reason == "max_tokens"


@pytest.fixture(scope="module")
def smol() -> Iterator[tuple[anthropic.Anthropic, str]]:
    yield from smollm_anthropic()


def test_p1_tool_runner_runs_unthreaded(smol: tuple[anthropic.Anthropic, str]) -> None:
    """P1: the SDK's tool runner (which opens a thread) runs two turns: the tool is called
    and its result sent back in the full history (SmolLM2: a tool's prompt outgrows the tiny
    model's 512-token context)."""
    calls: list[str] = []

    @beta_tool
    def get_weather(city: Literal["Rome"]) -> str:
        """Get the weather.

        Args:
            city: the city
        """
        calls.append(city)
        return "sunny"

    client, model = smol
    runner = client.beta.messages.tool_runner(
        model=model, max_tokens=40, tools=[get_weather], messages=_MSGS, max_iterations=2,
        tool_choice={"type": "any", "disable_parallel_tool_use": True})
    replies = list(runner)
    # NOTE: tool_choice "any": both turns call the tool, and the runner runs it after each
    assert [r.stop_reason for r in replies] == ["tool_use", "tool_use"], replies
    assert calls == ["Rome", "Rome"]
