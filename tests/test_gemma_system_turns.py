"""Gemma's built-in turn format keeps every system message (SPEC P1: nothing a client sends is
dropped silently; coda.models.tokenizer_bundle.GEMMA_CHAT_TEMPLATE). Gemma has no system role:
a system message's text opens the next user turn, and one that no user turn follows is a user
turn of its own. The old template kept only a first system message followed by a user turn: a
lone system message, a second one (Responses ``instructions`` plus a developer message) or one
mid-conversation rendered to nothing."""

from __future__ import annotations

from typing import Any

import pytest

from coda.models.tokenizer_bundle import GEMMA_CHAT_TEMPLATE
from coda.server.chat import _compile

GEN = "<start_of_turn>model\n"


def _render(messages: list[dict[str, Any]]) -> str:
    return _compile(GEMMA_CHAT_TEMPLATE).render(messages=messages, bos_token="<bos>",
                                                add_generation_prompt=True)


def _m(role: str, content: str) -> dict[str, Any]:
    return {"role": role, "content": content}


@pytest.mark.parametrize(("messages", "expected"), [
    ([_m("user", " hi ")], "<bos><start_of_turn>user\nhi<end_of_turn>\n" + GEN),
    ([_m("system", "Be brief. "), _m("user", "hi")],
     "<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n" + GEN),
    ([_m("system", "Be brief.")], "<bos><start_of_turn>user\nBe brief.<end_of_turn>\n" + GEN),
    ([_m("system", "A"), _m("system", "B"), _m("user", "hi"), _m("assistant", "yo"),
      _m("system", "C"), _m("user", "again")],
     "<bos><start_of_turn>user\nA\n\nB\n\nhi<end_of_turn>\n<start_of_turn>model\nyo"
     "<end_of_turn>\n<start_of_turn>user\nC\n\nagain<end_of_turn>\n" + GEN),
    ([_m("system", "A"), _m("assistant", "yo")],
     "<bos><start_of_turn>user\nA<end_of_turn>\n<start_of_turn>model\nyo<end_of_turn>\n" + GEN),
    ([_m("user", "q"), _m("tool", "42")],
     "<bos><start_of_turn>user\nq<end_of_turn>\n<start_of_turn>user\n42<end_of_turn>\n" + GEN),
])
def test_p1_gemma_turns_keep_every_system_message(messages: list[dict[str, Any]],
                                                  expected: str) -> None:
    """P1: each system text is in the prompt, where Gemma's format puts it."""
    assert _render(messages) == expected


def test_p1_gemma_system_text_appears_once_per_message() -> None:
    """P1: for any run of system and user messages, each system text occurs exactly once."""
    msgs = [_m("system", f"S{i}") if i % 3 else _m("user", f"U{i}") for i in range(10)]
    text = _render(msgs)
    assert all(text.count(f"S{i}") == 1 for i in range(10) if i % 3)
