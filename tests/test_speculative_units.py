"""speculative.py's rules one function at a time, against brute-force statements of the module
docstring (issue 21; SPEC T4, O1, L4, K2): the sample-and-match acceptance (row ``j`` is
accepted iff its draft equals the row's pick; the first mismatch emits the pick; all ``k``
matched: row ``k``'s pick is a bonus token), a verification's rows, the forced paths and the
reasoning closer's horizon, ``k``'s price, the measured-cost fit and the configuration's
bounds. The engine tests (tests/test_speculative*.py) check the same rules end to end against
plain decoding; these are the fast ones (and the mutation report's selection).

Fakes stand in for the output processor, the budget closer and the grammar: each exposes only
the attributes speculative.py reads.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from types import SimpleNamespace, TracebackType
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.engine.sampler import SamplingRow, TokenDecision
from coda.engine.sequence import Sequence as Seq
from coda.engine.speculative import SpeculativeConfig, refusal, state_for
from coda.engine.speculative_costs import DraftCosts
from coda.engine.speculative_state import SpecState
from coda.engine.speculative_verify import (
    _UNBOUNDED,
    accepted_prefix,
    closer_after,
    forced_drafts,
    forced_path,
    live_forced,
    plain_horizon,
    row_at,
    row_mask,
    verify_constrained,
    verify_rows,
)
from coda.reasoning import Phase, ReasoningSpec
from coda.sampling import SamplingParams
from tests.conftest import examples


def _dec(token: int) -> TokenDecision:
    return TokenDecision(token, -1.0, 0.5, (), False)


def _base(mask: torch.Tensor | None = None) -> SamplingRow:
    return SamplingRow(SamplingParams(temperature=0.8, seed=3), 3, 10, [1, 2], [5, 6],
                       frozenset({0}), mask)


def _decoding_seq(tokens: list[int], outputs: list[int], uncomputed: int = 1) -> Seq:
    seq = Seq(1, tokens, max_total_tokens=1000)
    seq.output_token_ids = list(outputs)
    seq.num_computed_tokens = seq.num_tokens - uncomputed
    return seq


# --- the acceptance rule ------------------------------------------------------------------

def _emitted_reference(drafts: list[int], picks: list[int]) -> list[int]:
    """The docstring's walk: each row's pick is emitted; the walk goes on past row j only
    while the draft of row j equals its pick (then the draft IS what was emitted)."""
    out = []
    for j, pick in enumerate(picks):
        out.append(pick)
        if j == len(drafts) or drafts[j] != pick:
            break
    return out


@settings(deadline=None, max_examples=examples(200))
@given(drafts=st.lists(st.integers(0, 2), max_size=6), data=st.data())
def test_t4_accepted_prefix_is_sample_and_match(drafts: list[int], data: st.DataObject) -> None:
    """T4: for all drafts and picks (one per row, ``k + 1``), the accepted count is the
    number of leading rows whose draft equals the pick, and the emitted tokens (the
    accepted drafts then row ``a``'s pick: the first mismatch's pick or the bonus) are the
    docstring's walk."""
    picks = data.draw(st.lists(st.integers(0, 2), min_size=len(drafts) + 1,
                               max_size=len(drafts) + 1))
    a = accepted_prefix(drafts, [_dec(p) for p in picks])
    assert 0 <= a <= len(drafts)
    assert drafts[:a] == picks[:a] and (a == len(drafts) or drafts[a] != picks[a])
    assert list(drafts[:a]) + [picks[a]] == _emitted_reference(drafts, picks)


def test_t4_all_drafts_match_then_the_last_row_is_a_bonus_token() -> None:
    assert accepted_prefix((4, 5), [_dec(4), _dec(5), _dec(9)]) == 2
    assert accepted_prefix((4, 5), [_dec(4), _dec(7), _dec(9)]) == 1
    assert accepted_prefix((4, 5), [_dec(3), _dec(5), _dec(9)]) == 0
    assert accepted_prefix((), [_dec(3)]) == 0


@dataclass
class _Ahead:
    """A grammar's lookahead: ``forbidden`` tokens are refused; the mask after ``n`` pushes
    is the one-hot of ``n`` (so a row's mask says how far the grammar was advanced)."""

    grammar: _Grammar
    pushed: list[int] = field(default_factory=list)

    def push(self, token: int) -> bool:
        if token in self.grammar.forbidden:
            return False
        self.pushed.append(token)
        return True

    def mask(self) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.tensor(len(self.pushed)), 16).bool()


@dataclass
class _Grammar:
    forbidden: frozenset[int]
    opened: list[_Ahead] = field(default_factory=list)
    closed: int = 0

    def lookahead(self) -> AbstractContextManager[_Ahead]:
        grammar = self

        class _Ctx(AbstractContextManager[_Ahead]):
            def __enter__(self) -> _Ahead:
                grammar.opened.append(_Ahead(grammar))
                return grammar.opened[-1]

            def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                         tb: TracebackType | None) -> None:
                grammar.closed += 1

        return _Ctx()


@settings(deadline=None, max_examples=examples(200))
@given(drafts=st.lists(st.integers(0, 3), max_size=5),
       forbidden=st.frozensets(st.integers(0, 3), max_size=1),
       refused=st.frozensets(st.tuples(st.integers(0, 3), st.integers(0, 4)), max_size=2),
       closer=st.booleans(), forced=st.lists(st.none() | st.integers(0, 15), max_size=6),
       data=st.data())
def test_t4_l4_verify_constrained_samples_a_row_only_after_its_prefix_is_accepted(
        drafts: list[int], forbidden: frozenset[int], refused: frozenset[tuple[int, int]],
        closer: bool, forced: list[int | None], data: st.DataObject) -> None:
    """T4, L4 (module docstring "Constrained requests"): for all drafts, picks, grammars and
    closers, ``d_j`` is accepted iff it equals row ``j``'s pick, the closer admits it there
    and the grammar takes it; row ``j + 1`` is sampled only then, as ``row_at(base, drafts,
    j + 1)`` with the grammar's mask after ``d_0 .. d_j`` (a forced row: its one-token mask);
    the lookahead is closed (rolled back) after, whatever the outcome."""
    # NOTE: mostly the draft itself, so that long accepted runs are common
    picks = [data.draw(st.sampled_from([d, d, d, (d + 1) % 4])) for d in drafts] + \
        [data.draw(st.integers(0, 3))]
    grammar = _Grammar(forbidden)
    calls: list[tuple[int, SamplingRow]] = []

    def sample(j: int, row: SamplingRow) -> TokenDecision:
        calls.append((j, row))
        return _dec(picks[j])

    def admits(d: int, j: int) -> bool:
        return (d, j) not in refused

    base = _base()
    decs, a = verify_constrained(base, _dec(picks[0]), drafts, grammar,  # type: ignore[arg-type]
                                 sample, admits if closer else None, forced, 16)
    want = 0
    while want < len(drafts) and picks[want] == drafts[want] and drafts[want] not in forbidden \
            and (not closer or (drafts[want], want) not in refused):
        want += 1
    assert a == want
    assert [d.token_id for d in decs] == picks[:a + 1]
    assert [j for j, _ in calls] == list(range(1, a + 1))
    for j, row in calls:
        assert row.step == base.step + j
        assert list(row.output_token_ids) == list(base.output_token_ids) + drafts[:j]
        tok = forced[j] if j < len(forced) else None
        assert row.allowed_token_ids_mask is not None
        assert row.allowed_token_ids_mask.nonzero().flatten().tolist() == [
            j if tok is None else tok]
    assert grammar.closed == 1 and grammar.opened[0].pushed == drafts[:a]


def test_l4_a_closer_that_refuses_a_matching_draft_stops_before_the_grammar_takes_it() -> None:
    """L4: the closer's check comes before the grammar's advance (the grammar never consumes
    a draft the closer refused)."""
    grammar = _Grammar(frozenset())
    decs, a = verify_constrained(_base(), _dec(4), (4, 5), grammar,  # type: ignore[arg-type]
                                 lambda j, r: _dec(5), lambda d, j: j == 0)
    assert a == 1 and [d.token_id for d in decs] == [4, 5]
    assert grammar.opened[0].pushed == [4]
    decs, a = verify_constrained(_base(), _dec(4), (), grammar,  # type: ignore[arg-type]
                                 lambda j, r: _dec(5))
    assert (a, [d.token_id for d in decs]) == (0, [4])


def test_o1_verify_constrained_gives_a_forced_row_its_one_token_mask() -> None:
    """O1: a forced row is sampled with plain decoding's one-token mask, not the grammar's
    (the grammar is advanced past the draft all the same)."""
    grammar = _Grammar(frozenset())
    rows: list[SamplingRow] = []

    def sample(j: int, row: SamplingRow) -> TokenDecision:
        rows.append(row)
        return _dec((4, 9, 2)[j])

    decs, a = verify_constrained(_base(), _dec(4), (4, 9), grammar,  # type: ignore[arg-type]
                                 sample, None, (None, 9, None), 16)
    assert a == 2 and [d.token_id for d in decs] == [4, 9, 2]
    masks = [r.allowed_token_ids_mask for r in rows]
    assert masks[0] is not None and masks[0].nonzero().flatten().tolist() == [9]
    assert masks[1] is not None and masks[1].nonzero().flatten().tolist() == [2]  # 2 pushed
    assert grammar.opened[0].pushed == [4, 9]


# --- a verification's rows ---------------------------------------------------------------

def test_t4_row_0_is_the_base_row_itself_mask_and_all() -> None:
    """T4: row 0 is plain decoding's row now (its grammar mask kept); row j is step t + j
    after drafts[:j], with the mask given for it."""
    mask = torch.tensor([True, False, True])
    base = _base(mask)
    assert row_at(base, (7, 8), 0) is base
    r2 = row_at(base, (7, 8), 2, None)
    assert (r2.step, list(r2.output_token_ids), r2.allowed_token_ids_mask) == (12, [5, 6, 7, 8],
                                                                               None)
    assert r2.seed == base.seed and r2.prompt_token_ids == base.prompt_token_ids


def test_o1_row_mask_is_the_forced_token_alone_or_none() -> None:
    """O1: a forced row's mask is plain decoding's one-token mask; an unforced row (None) or
    a row past the forced ones has none."""
    forced = (None, 2, None)
    assert row_mask(forced, 0, 4) is None and row_mask(forced, 2, 4) is None
    assert row_mask(forced, 3, 4) is None and row_mask((), 0, 4) is None
    mask = row_mask(forced, 1, 4)
    assert mask is not None and mask.dtype == torch.bool
    assert mask.tolist() == [False, False, True, False]
    rows = verify_rows(_base(), (2, 3), forced, 4)
    assert [r.allowed_token_ids_mask is None for r in rows] == [True, False, True]
    assert rows[0] is not None and rows[1].allowed_token_ids_mask is not None
    assert rows[1].allowed_token_ids_mask.tolist() == [False, False, True, False]


# --- forced paths and the reasoning closer's horizon ---------------------------------------

def _processor(forced_tokens: tuple[int, ...] = (), forced_token: int | None = None,
               splitter: Any = None, reasoning_tokens: int = 0) -> Any:
    return SimpleNamespace(forced_tokens=lambda: forced_tokens,
                           forced_token=lambda: forced_token, splitter=splitter,
                           reasoning_tokens=reasoning_tokens)


def _closer(tokens: tuple[int, ...] | None, consumed: int = 5, forced_at: int = 3,
            forcing: bool = False) -> Any:
    path = None if tokens is None else SimpleNamespace(tokens=tokens)
    return SimpleNamespace(path=path, grammar=SimpleNamespace(num_consumed=consumed),
                           forced_at=forced_at, forcing=forcing)


def _splitter(phase: Phase = Phase.REASONING, budget: int | None = 6,
              close_ids: tuple[int, ...] = (90, 91, 92)) -> Any:
    return SimpleNamespace(phase=phase, in_reasoning=phase is Phase.REASONING,
                           spec=ReasoningSpec(close_ids=close_ids, budget_tokens=budget))


def test_k2_l4_forced_path_is_the_reasoning_closer_first_then_the_closers_rest() -> None:
    """K2, L4: the reasoning budget's closer ids (the answer follows: not the end), else the
    closing path from the grammar's position on (it ends the request), else nothing."""
    path = (40, 41, 42, 43)
    assert forced_path(_processor((7, 8)), _closer(path)) == ((7, 8), False)
    # NOTE: 5 consumed, forced at 3: two of the path chosen already
    assert forced_path(_processor(), _closer(path)) == ((42, 43), True)
    assert forced_path(_processor(), _closer(None)) == ((), False)
    assert forced_path(_processor(), None) == ((), False)


def test_l4_live_forced_is_the_next_token_of_the_path_or_minus_1_past_its_end() -> None:
    """L4: the loop's next row is forced to the processor's token, else to the closing
    path's token at the grammar's position; -1 once the path is chosen to its end."""
    path = (40, 41, 42)
    assert live_forced(_processor(forced_token=9), _closer(path)) == 9
    assert live_forced(_processor(forced_token=0), None) == 0
    assert live_forced(_processor(), None) is None
    assert live_forced(_processor(), _closer(None)) is None
    assert live_forced(_processor(), _closer(path, consumed=3)) == 40
    assert live_forced(_processor(), _closer(path, consumed=5)) == 42  # the last
    assert live_forced(_processor(), _closer(path, consumed=6)) == -1  # past the end


def test_l4_o1_forced_drafts_are_the_path_without_what_the_last_row_picks() -> None:
    """L4, O1: the forced path is drafted, without its last token where that ends the
    request, at most ``k_max`` and never past the budget; ``spec.forced`` is the whole path
    (set even when nothing can be drafted now)."""
    spec = SpecState(SpeculativeConfig(k_max=3))
    seq = _decoding_seq([1, 2, 3], [4])
    proc = _processor((7, 8))
    assert forced_drafts(spec, seq, 100, proc, None) == (7, 8)  # the answer follows
    assert spec.forced == (7, 8)
    path = (40, 41, 42, 43, 44, 45)
    closer = _closer(path, consumed=3)
    assert forced_drafts(spec, seq, 100, _processor(), closer) == (40, 41, 42)  # k_max
    assert spec.forced == path
    closer = _closer((40, 41, 42), consumed=3)
    assert forced_drafts(spec, seq, 100, _processor(), closer) == (40, 41)  # the last: a pick
    assert forced_drafts(spec, seq, 3, _processor(), closer) == (40, 41)
    assert forced_drafts(spec, seq, 2, _processor(), closer) == (40,)  # the budget
    assert forced_drafts(spec, seq, 1, _processor(), closer) == ()
    assert forced_drafts(spec, seq, 0, _processor(), closer) == ()
    spec.forced = (1,)
    assert forced_drafts(spec, seq, 100, _processor(), None) == () and spec.forced == ()
    two = _decoding_seq([1, 2, 3], [4], uncomputed=2)
    assert forced_drafts(spec, two, 100, proc, None) == () and spec.forced == (7, 8)


def test_k2_closer_after_follows_guesses_that_reach_the_horizon_with_the_closer() -> None:
    """K2: guesses that reach the horizon inside a reasoning block with a budget are followed
    by the closer's ids (``forced`` marks them), cut to ``k_max`` and to the room left;
    anything else is returned unchanged (and ``forced`` untouched)."""
    spec = SpecState(SpeculativeConfig(k_max=2))
    proc = _processor(splitter=_splitter())
    assert closer_after(spec, (5, 6), 2, proc, 10) == (5, 6, 90, 91)  # k_max
    assert spec.forced == (None, None, 90, 91)
    assert closer_after(spec, (5, 6), 2, proc, 3) == (5, 6, 90)  # the room
    assert spec.forced == (None, None, 90)
    spec.forced = ()
    for drafts, horizon, p, room in [
            ((5, 6), 2, proc, 2),                                   # no room left
            ((5, 6), 2, proc, 1),
            ((), 0, proc, 10),                                      # no guesses
            ((5, 6), 3, proc, 10),                                  # short of the horizon
            ((5, 6), 1, proc, 10),
            ((5, 6), 2, _processor(), 10),                          # no splitter
            ((5, 6), 2, _processor(splitter=_splitter(Phase.ANSWER)), 10),
            ((5, 6), 2, _processor(splitter=_splitter(budget=None)), 10),
            ((5, 6), 2, _processor(splitter=_splitter(close_ids=())), 10)]:
        assert closer_after(spec, drafts, horizon, p, room) == drafts
        assert spec.forced == ()


def test_k2_l4_plain_horizon_is_the_reasoning_budget_left() -> None:
    """K2, L4: 0 while something is forced; the budget's tokens left inside (or before) a
    reasoning block with a budget (never below 0); unbounded otherwise."""
    sp = _splitter(budget=6)
    assert plain_horizon(_processor(splitter=sp, reasoning_tokens=2), None) == 4
    assert plain_horizon(_processor(splitter=sp, reasoning_tokens=6), None) == 0
    assert plain_horizon(_processor(splitter=sp, reasoning_tokens=9), None) == 0
    assert plain_horizon(_processor(splitter=_splitter(Phase.OPENING), reasoning_tokens=1),
                         None) == 5
    assert plain_horizon(_processor(splitter=sp), _closer((1,), forcing=True)) == 0
    assert plain_horizon(_processor(splitter=sp, reasoning_tokens=2),
                         _closer((1,), forcing=False)) == 4
    assert plain_horizon(_processor(forced_token=0, splitter=sp), None) == 0
    assert plain_horizon(_processor(), None) == _UNBOUNDED
    assert plain_horizon(_processor(splitter=_splitter(Phase.ANSWER)), None) == _UNBOUNDED
    assert plain_horizon(_processor(splitter=_splitter(budget=None)), None) == _UNBOUNDED


# --- drafting: the state, k and proposals ------------------------------------------------

def test_config_bounds_each_on_both_sides() -> None:
    """Each bound of the configuration accepts its edge and refuses one past it."""
    for ok in [dict(min_ngram=1, max_ngram=1), dict(min_ngram=3, max_ngram=3), dict(k_max=1),
               dict(step_rows=0.0), dict(window=1), dict(candidates=1),
               dict(prior_accept=0.01), dict(prior_accept=0.99)]:
        SpeculativeConfig(**ok)  # type: ignore[arg-type]
    for bad in [dict(min_ngram=0, max_ngram=1), dict(min_ngram=3, max_ngram=2), dict(k_max=0),
                dict(step_rows=-0.1), dict(prior_accept=0.0), dict(prior_accept=1.0),
                dict(window=0), dict(candidates=0)]:
        with pytest.raises(ValueError):
            SpeculativeConfig(**bad)  # type: ignore[arg-type]


def test_t4_refusal_names_the_mode_and_why() -> None:
    """T4: speculation needs a batch-invariant mode; "off" always runs; an unknown mode is
    refused whatever the load."""
    assert refusal("off", False, "q4") is None
    assert refusal("prompt-lookup", True, "auto") is None and refusal("draft", True, "x") is None
    why = refusal("prompt-lookup", False, "q4_0")
    assert why is not None and "q4_0" in why and "prompt-lookup" in why
    unknown = refusal("medusa", True, "auto")
    assert unknown is not None and "medusa" in unknown and "prompt-lookup" in unknown


def test_state_for_speculates_only_where_server_and_request_both_do() -> None:
    cfg = SpeculativeConfig()
    on, off = (SimpleNamespace(speculative=s, prediction=None) for s in (True, False))
    state = state_for(cfg, on)  # type: ignore[arg-type]
    assert isinstance(state, SpecState) and state.config is cfg
    assert state_for(cfg, off) is None  # type: ignore[arg-type]
    assert state_for(None, on) is None  # type: ignore[arg-type]


@settings(deadline=None, max_examples=examples(200))
@given(a=st.floats(0.01, 0.99), rows=st.integers(1, 16), k_max=st.integers(1, 10),
       step_rows=st.floats(0.0, 4.0))
def test_k_is_the_largest_j_whose_chance_beats_the_rate_without_it(
        a: float, rows: int, k_max: int, step_rows: float) -> None:
    """For all acceptances and crowds: ``k`` is the largest ``j <= k_max`` with
    ``a**j > N / (F + N)`` (0 when none)."""
    state = SpecState(SpeculativeConfig(k_max=k_max, step_rows=step_rows))
    threshold = rows / (step_rows + rows)
    want = max((j for j in range(1, k_max + 1) if a ** j > threshold), default=0)
    if all(abs(a ** j - threshold) > 1e-9 for j in range(1, k_max + 1)):
        assert state.k_for(rows, a) == want


def test_k_stops_where_the_chance_only_equals_the_rate() -> None:
    """The comparison is strict: a draft whose chance is exactly the step's rate is not worth
    its row (a = 0.5 against 1 / (1 + 1))."""
    state = SpecState(SpeculativeConfig(step_rows=1.0))
    assert state.k_for(1, 0.5) == 0
    assert state.k_for(1, 0.75) == 2  # 0.75, 0.5625 > 0.5 > 0.42


def test_propose_needs_room_and_one_uncomputed_token_and_records_the_match() -> None:
    """The pick takes one token of the budget: no drafts (and no lookup) without room beyond
    it or with more than the pending token uncomputed; ``match_length`` is the last lookup's
    agreement, 0 before any and after one that finds nothing."""
    state = SpecState(SpeculativeConfig(min_ngram=2, max_ngram=3, k_max=3, prior_accept=0.99))
    assert state.match_length == 0
    copying = _decoding_seq([1, 2, 3, 9, 9, 5, 1, 2, 3, 7, 8, 6, 4], [2, 3])
    assert state.propose(copying, tokens_left=1) == () and state.match_length == 0
    assert state.propose(copying, tokens_left=0) == () and state.match_length == 0
    two = _decoding_seq([1, 2, 3, 9, 9, 5, 1, 2, 3, 7, 8, 6, 4], [2, 3], uncomputed=2)
    assert state.propose(two, tokens_left=50) == () and state.match_length == 0
    assert state.propose(copying, tokens_left=50) == (7, 8, 6) and state.match_length == 2
    assert state.propose(_decoding_seq([5, 6, 7], [8]), 50) == () and state.match_length == 0


# --- measured costs (a draft model's k) ----------------------------------------------------

def _fit_reference(obs: list[tuple[int, int, float]], decay: float, w: float,
                   q: float) -> tuple[float, float]:
    """argmin over (p, r) of sum decay^age (y - N p - x r)^2 + w (r - q p)^2, solved by
    numpy's least squares on the weighted rows (the prior as one more row)."""
    n = len(obs)
    rows = [[np.sqrt(decay ** (n - 1 - i)) * s, np.sqrt(decay ** (n - 1 - i)) * x]
            for i, (s, x, _) in enumerate(obs)] + [[-np.sqrt(w) * q, np.sqrt(w)]]
    ys = [np.sqrt(decay ** (n - 1 - i)) * y for i, (_, _, y) in enumerate(obs)] + [0.0]
    (p, r), *_ = np.linalg.lstsq(np.array(rows), np.array(ys), rcond=None)
    return max(float(p), 1e-9), max(float(r), 0.0)


@settings(deadline=None, max_examples=examples(100))
@given(obs=st.lists(st.tuples(st.integers(1, 8), st.integers(0, 16), st.floats(0.001, 1.0)),
                    min_size=1, max_size=12),
       step_rows=st.sampled_from([0.0, 1.2, 3.0]), w=st.sampled_from([1e-4, 0.5, 2.0]))
def test_step_fit_is_the_decayed_least_squares_with_its_prior(
        obs: list[tuple[int, int, float]], step_rows: float, w: float) -> None:
    """For all observed steps: ``step()`` is the exponentially decayed (0.9 by default) least
    squares fit of ``seconds = N plain + x row`` with the prior ``row = plain / (1 + F)`` of
    weight ``w``; it counts the forwards."""
    costs = DraftCosts(step_rows=step_rows, prior_weight=w)
    for s, x, y in obs:
        costs.observe_step(s, x, y)
    assert costs.forwards == len(obs)
    got = costs.step()
    assert got is not None
    want = _fit_reference(obs, 0.9, w, 1.0 / (1.0 + step_rows))
    assert got == pytest.approx(want, rel=1e-6, abs=1e-9)


def test_step_fit_without_drafted_rows_is_the_prior_ratio() -> None:
    """No drafted row seen: the prior alone decides the row, ``plain / (1 + F)``."""
    costs = DraftCosts(step_rows=1.5)
    assert costs.step() is None
    costs.observe_step(1, 0, 0.02)
    assert costs.step() == pytest.approx((0.02, 0.02 / 2.5), rel=1e-9)


def test_draft_cost_is_a_decayed_average_per_sequence() -> None:
    """A draft forward's cost is per sequence, averaged with decay 0.9; ``choose`` waits for
    two of each kind of forward."""
    costs = DraftCosts()
    costs.observe_draft(2, 0.4)
    assert costs.draft == pytest.approx(0.2) and costs.draft_forwards == 1
    costs.observe_draft(1, 0.3)
    assert costs.draft == pytest.approx(0.9 * 0.2 + 0.1 * 0.3) and costs.draft_forwards == 2


def _choose_reference(plain: float, per_draft: float, a: float, k_max: int, seqs: int) -> int:
    rates = [(seqs + sum(a ** j for j in range(1, k + 1))) / (seqs * plain + k * per_draft)
             for k in range(k_max + 1)]
    return max(range(k_max + 1), key=lambda k: (rates[k], -k))


def test_choose_waits_for_two_forwards_of_each_kind() -> None:
    costs = DraftCosts()
    assert costs.choose(0.9, 4) is None
    costs.observe_draft(1, 0.001)
    costs.observe_draft(1, 0.001)
    assert costs.choose(0.9, 4) is None  # NOTE: no target step yet
    costs.observe_step(1, 0, 0.05)
    assert costs.choose(0.9, 4) is None  # NOTE: one target step
    costs.observe_step(1, 2, 0.06)
    assert costs.choose(0.9, 4) is not None
    fresh = DraftCosts()
    fresh.observe_step(1, 0, 0.05)
    fresh.observe_step(1, 2, 0.06)
    assert fresh.choose(0.9, 4) is None  # NOTE: no draft forward
    fresh.observe_draft(1, 0.001)
    assert fresh.choose(0.9, 4) is None  # NOTE: one draft forward


@settings(deadline=None, max_examples=examples(100))
@given(a=st.floats(0.0, 1.0), k_max=st.integers(1, 8), seqs=st.integers(1, 4),
       draft=st.floats(0.0, 0.05))
def test_choose_is_the_k_with_the_most_tokens_per_second(a: float, k_max: int, seqs: int,
                                                         draft: float) -> None:
    """For all acceptances: ``choose`` is the ``k`` maximising ``E(k) / (N plain + k (row +
    draft))`` (the smallest such ``k``), by default for one sequence."""
    costs = DraftCosts(prior_weight=0.0)
    for x, y in [(0, 0.05), (2, 0.06), (4, 0.07)]:
        costs.observe_step(1, x, y)
        costs.observe_draft(1, draft)
    step = costs.step()
    assert step is not None and costs.draft is not None
    plain, row = step
    want = _choose_reference(plain, row + costs.draft, a, k_max, seqs)
    assert costs.choose(a, k_max, seqs) == want
    if seqs == 1:
        assert costs.choose(a, k_max) == want


def test_choose_one_draft_and_a_tie_keeps_the_fewer_drafts() -> None:
    """k = 1 can be the best; a draft that neither costs nor emits anything is not taken."""
    costs = DraftCosts(prior_weight=0.0)
    for x, y in [(0, 1.0), (1, 1.5), (2, 2.0)]:
        costs.observe_step(1, x, y)
        costs.observe_draft(1, 0.0)
    assert costs.choose(0.6, 4) == 1  # (1.6 / 1.5 > 1 > 1.96 / 2)
    free = DraftCosts(prior_weight=0.0)
    for x in (0, 1, 2):
        free.observe_step(1, x, 1.0)
        free.observe_draft(1, 0.0)
    assert free.step() == pytest.approx((1.0, 0.0), abs=1e-12)
    assert free.choose(0.0, 4) == 0


def test_choose_is_for_one_sequence_unless_told() -> None:
    """Issue 21 item 2: a draft's cost is shared by fewer tokens at batch 1, so a crowd of
    speculating sequences drafts more: the default is one sequence."""
    costs = DraftCosts(prior_weight=0.0)
    for x, y in [(0, 0.05), (2, 0.06), (4, 0.07)]:  # NOTE: plain 0.05 s, a row 0.005 s
        costs.observe_step(1, x, y)
        costs.observe_draft(1, 0.004)
    assert costs.choose(0.8, 8) == costs.choose(0.8, 8, 1) == 4
    assert costs.choose(0.8, 8, 2) == 5


# --- a chat prediction as the draft source (coda.engine.prediction) --------------------------

def test_o1_state_for_a_prediction_drafts_under_the_prediction_config_flag_or_not() -> None:
    """O1: a request with a prediction drafts from it under the engine's prediction config
    whether or not the server speculates; where the mode cannot verify (no prediction config)
    it is a hint: the server's own drafting, or none; ``speculative: false`` wins."""
    cfg, pcfg = SpeculativeConfig(), SpeculativeConfig(lookup=False)
    plan = SimpleNamespace(speculative=True, prediction=(4, 5, 6))
    off = SimpleNamespace(speculative=False, prediction=(4, 5, 6))
    plain = SimpleNamespace(speculative=True, prediction=None)
    for server in (None, cfg):
        state = state_for(server, plan, pcfg)  # type: ignore[arg-type]
        assert isinstance(state, SpecState) and state.config is pcfg
        assert state.predicted is not None and state.predicted.prediction == (4, 5, 6)
        assert state_for(server, off, pcfg) is None  # type: ignore[arg-type]
    hint = state_for(cfg, plan, None)  # type: ignore[arg-type]
    assert isinstance(hint, SpecState) and hint.config is cfg and hint.predicted is None
    assert state_for(None, plan, None) is None  # type: ignore[arg-type]
    assert state_for(None, plain, pcfg) is None  # type: ignore[arg-type]
    own = state_for(cfg, plain, pcfg)  # type: ignore[arg-type]
    assert isinstance(own, SpecState) and own.config is cfg and own.predicted is None


def test_t4_propose_drafts_the_prediction_from_its_start_then_where_two_tokens_align() -> None:
    """T4: before any output the drafts are the prediction's first tokens; after, they follow
    where the output's last 2+ tokens align (``match_length`` is that agreement) and never
    exceed the room the budget leaves after the pick; one aligned token alone does not draft
    from the prediction (prompt lookup over the request's own tokens, if on, does)."""
    pred = [10, 11, 12, 13, 14, 15]
    cfg = SpeculativeConfig(min_ngram=2, max_ngram=3, k_max=3, prior_accept=0.99, lookup=False)
    prompt = [5, 6, 7]
    state = SpecState(cfg, pred)
    assert state.propose(_decoding_seq(prompt, []), 50) == (10, 11, 12)
    assert state.match_length == 0
    assert state.propose(_decoding_seq(prompt, [10, 11]), 50) == (12, 13, 14)
    assert state.match_length == 2
    assert state.propose(_decoding_seq(prompt, [10, 11]), tokens_left=3) == (12, 13)
    # NOTE: joined mid-prediction (position 4, agreeing over 2); room for one draft only
    assert state.propose(_decoding_seq(prompt, [99, 12, 13]), 50) == (14, 15)
    assert state.propose(_decoding_seq(prompt, [99, 12, 13]), tokens_left=2) == (14,)
    # NOTE: the prompt is not output: its last tokens equal the prediction's first two, but
    # the output (one token, agreeing over one) does not align over two
    state = SpecState(cfg, pred)
    assert state.propose(_decoding_seq([10, 11], [12]), 50) == ()
    assert state.propose(_decoding_seq([1, 2, 3], [99, 12]), 50) == ()
    looked = SpecState(SpeculativeConfig(min_ngram=2, max_ngram=3, k_max=3, prior_accept=0.99),
                       pred)
    own = _decoding_seq([1, 2, 3, 9, 9, 5, 1, 2], [3, 99, 12])
    assert looked.propose(own, 50) == ()  # NOTE: 99, 12 occurs nowhere: no own match either
    looked = SpecState(looked.config, pred)  # NOTE: a new request (its index grows by appends)
    own = _decoding_seq([1, 2, 3, 9, 12, 5, 1, 2], [3, 99, 9, 12])
    assert looked.propose(own, 50) == (5, 1, 2)  # NOTE: 9, 12 in its own tokens
    assert SpecState(cfg, pred).propose(own, 50) == ()  # NOTE: lookup off: nothing


def test_t4_propose_prices_a_prediction_draft_by_its_agreement_and_k_0_leaves_the_point() -> None:
    """T4: ``k`` comes from the acceptance at the match's agreement (a longer agreement drafts
    more); where no draft is worth its row nothing is drafted and the point stays."""
    pred = list(range(10, 40))
    cfg = SpeculativeConfig(min_ngram=2, max_ngram=3, k_max=8, prior_accept=0.5,
                            step_rows=1.0, lookup=False)
    short, long_ = SpecState(cfg, pred), SpecState(cfg, pred)
    got_short = short.propose(_decoding_seq([1], [20, 21]), 50)
    got_long = long_.propose(_decoding_seq([1], list(range(10, 22))), 50)
    k_short = short.k_for(1, short.acceptance_at(2))
    k_long = long_.k_for(1, long_.acceptance_at(12))
    assert k_long > k_short
    assert got_short == tuple(range(22, 22 + k_short)) and got_long == tuple(range(22, 22 + k_long))
    stingy = SpecState(SpeculativeConfig(min_ngram=2, max_ngram=3, prior_accept=0.05,
                                         step_rows=0.0, lookup=False), pred)
    assert stingy.propose(_decoding_seq([1], [20, 21]), 50) == ()
    assert stingy.predicted is not None and stingy.predicted.point == 0
