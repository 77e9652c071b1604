"""The speculative tests' memo of plain decoding (``tests/plain_memo.py``; SPEC T4's oracle):
a result is reused only for an equal request list on the same engine, and an engine whose rerun
could differ (speculative, prefix-caching) is refused."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

import tests.plain_memo as memo
from coda.engine.types import GenerationRequest, GrammarSpec


@dataclass
class _Config:
    enable_prefix_caching: bool = False


@dataclass(eq=False)
class _Engine:
    """What plain_run reads of an engine; ``runs`` counts the real runs."""

    speculative: object = None
    config: _Config = field(default_factory=_Config)
    runs: list[tuple[tuple[GenerationRequest, ...], bool]] = field(default_factory=list)


def _fake_run(engine: Any, reqs: Sequence[GenerationRequest], crowd: bool = True) -> list[Any]:
    engine.runs.append((tuple(reqs), crowd))
    return [("result", len(engine.runs), i) for i in range(len(reqs))]


@pytest.fixture(autouse=True)
def _counted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memo, "_run", _fake_run)


def test_one_run_per_engine_request_list_and_crowd() -> None:
    """The same engine, equal requests (a grammar's dict included) and the same crowd flag:
    one run; another request, crowd flag or engine: a run of its own."""
    a = GenerationRequest((1, 2, 3), max_tokens=4, grammar=GrammarSpec(json_schema={"a": 1}))
    eng, other = _Engine(), _Engine()
    first = memo.plain_run(eng, [a], crowd=False)  # type: ignore[arg-type]
    again = memo.plain_run(eng, [replace(a)], crowd=False)  # type: ignore[arg-type]
    assert again == first and len(eng.runs) == 1
    memo.plain_run(eng, [a], crowd=True)  # type: ignore[arg-type]
    memo.plain_run(eng, [replace(a, max_tokens=5)], crowd=False)  # type: ignore[arg-type]
    memo.plain_run(eng, [a, a], crowd=False)  # type: ignore[arg-type]
    assert len(eng.runs) == 4
    memo.plain_run(other, [a], crowd=False)  # type: ignore[arg-type]
    assert len(other.runs) == 1


def test_refuses_an_engine_whose_rerun_could_differ() -> None:
    """A speculative engine is no reference; a prefix cache makes usage depend on what ran
    before."""
    req = GenerationRequest((1, 2), max_tokens=2)
    with pytest.raises(AssertionError, match="plain decoding"):
        memo.plain_run(_Engine(speculative=object()), [req])  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="earlier runs"):
        memo.plain_run(_Engine(config=_Config(True)), [req])  # type: ignore[arg-type]
