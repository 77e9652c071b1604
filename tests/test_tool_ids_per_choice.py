"""Tool call ids are unique within a response, across its choices (`n` > 1): OpenAI's ids
name one call each, and a client that continues any choice's conversation links its tool
results by them (docs/api.md "Tool calling"; SPEC P3: the ids stay a pure function of the
request, so a resumed stream repeats them)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.tools_support import ASK, OA_TOOLS, Wire, serve


@pytest.fixture(scope="module")
def wire() -> Iterator[Wire]:
    yield from serve()


def _kwargs(wire: Wire) -> dict[str, Any]:
    return dict(model=wire.model, messages=ASK, tools=OA_TOOLS, n=3, seed=1, temperature=0,
                max_tokens=60, parallel_tool_calls=False,
                tool_choice={"type": "function", "function": {"name": "get_time"}})


def test_p3_call_ids_differ_between_choices_not_streamed(wire: Wire) -> None:
    """Three choices, each one forced call: three distinct ids (greedy, so the calls are the
    same: only the id tells them apart); choice 0 keeps the single-choice form."""
    r = wire.oa.chat.completions.create(**_kwargs(wire))
    ids = [tc.id for ch in r.choices for tc in ch.message.tool_calls or []]
    assert len(ids) == 3 and len(set(ids)) == 3, ids
    single = wire.oa.chat.completions.create(**{**_kwargs(wire), "n": 1})
    assert single.choices[0].message.tool_calls
    rid_tail = single.id[-16:]
    assert single.choices[0].message.tool_calls[0].id == f"call_{rid_tail}_0"


def test_p3_call_ids_differ_between_choices_streamed(wire: Wire) -> None:
    """The same streamed: each choice's call delta carries its own id, equal to what the
    non-streamed form would give that choice."""
    ids: dict[int, list[str]] = {}
    rid = ""
    stream: Any = wire.oa.chat.completions.create(stream=True, **_kwargs(wire))
    for chunk in stream:
        rid = chunk.id
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                if d.id:
                    ids.setdefault(ch.index, []).append(d.id)
    flat = [i for k in sorted(ids) for i in ids[k]]
    assert sorted(ids) == [0, 1, 2] and len(set(flat)) == 3, ids
    assert ids[0] == [f"call_{rid[-16:]}_0"]


def test_p3_one_choice_ids_unchanged(wire: Wire) -> None:
    """A one-choice request's ids keep their form (`call_<tail>_<position>`), so ids that
    clients already stored keep linking."""
    r = wire.oa.chat.completions.create(**{**_kwargs(wire), "n": 1})
    calls = r.choices[0].message.tool_calls or []
    assert calls and [c.id for c in calls] == [f"call_{r.id[-16:]}_{i}"
                                               for i in range(len(calls))]
