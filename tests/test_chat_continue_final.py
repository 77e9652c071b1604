"""Chat ``continue_final_message`` as vLLM takes it (SPEC P1: a clear 400, never a guess).

It continues the last message, which must be an assistant message; beside an explicit
``add_generation_prompt: true`` (open a new assistant turn) it contradicts itself: a 400
naming both fields, as vLLM's. Left out, ``add_generation_prompt`` (default true) asks for
nothing, so ``continue_final_message`` alone continues the message. Before, the
contradiction was accepted and the flag silently ignored.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.test_server_openai import MODEL

_PREFILL = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]


def _chat(url: str, messages: list[dict[str, str]], **extra: Any) -> str | None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
    out = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                         max_tokens=4, temperature=0, extra_body=extra)
    return out.choices[0].message.content


def test_p1_continue_final_message_with_add_generation_prompt_is_a_400(server_live: Any
                                                                        ) -> None:
    """P1: both true (official client) → 400 ``invalid_request_error`` naming both fields;
    ``continue_final_message`` alone, or with ``add_generation_prompt: false``, continues
    the assistant message (200, the same greedy text)."""
    with pytest.raises(openai.BadRequestError) as e:
        _chat(server_live.url, _PREFILL, continue_final_message=True,
              add_generation_prompt=True)
    body: Any = e.value.body
    assert body["param"] == "continue_final_message", body
    assert "add_generation_prompt" in body["message"], body
    alone = _chat(server_live.url, _PREFILL, continue_final_message=True)
    assert alone == _chat(server_live.url, _PREFILL, continue_final_message=True,
                          add_generation_prompt=False)


def test_p1_continue_final_message_needs_a_final_assistant_message(server_live: Any) -> None:
    """P1: ``continue_final_message`` after a user message → 400 (nothing to continue)."""
    with pytest.raises(openai.BadRequestError) as e:
        _chat(server_live.url, _PREFILL[:1], continue_final_message=True,
              add_generation_prompt=False)
    assert "continue_final_message" in e.value.body["message"]  # type: ignore[index]
