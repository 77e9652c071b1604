"""Structured output closes within the budget (issue 13 item 2; SPEC L4, L5, G1, O1).

With closure on (the default for json_schema) a tight max_tokens still yields output that
validates, ending ``grammar_forced_close`` (``stop`` on the OpenAI wire); without it the same
requests are cut mid-structure. A budget below the shortest completion is a 400 naming
max_tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import llguidance as llg
import openai
import pytest
import tokenizers
from hypothesis import given
from hypothesis import strategies as st

from coda.engine.async_engine import DEFAULT_MODEL_DIR, AsyncEngine
from coda.engine.closure_walk import byte_table, closing_path
from coda.engine.grammar import grammar_source
from coda.engine.grammar_tokenizer import ll_tokenizer
from coda.engine.types import EngineConfig, GenerationRequest, GrammarSpec
from coda.errors import InvalidRequestError
from coda.finish import FinishReason
from coda.sampling import SamplingParams
from coda.trace import GRAMMAR_FORCED, ListTraceSink
from tests.conftest import LiveServer

RECORD: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "age", "tags", "note"],
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string"}},
                   "note": {"type": "string"}}}
PROMPT = "Answer as JSON:"


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncEngine]:
    with AsyncEngine.from_model_dir(None, EngineConfig(max_num_seqs=16)) as eng:
        yield eng


def _run(engine: AsyncEngine, closure: bool, seeds: range, budget: int) -> list[tuple[str, Any]]:
    ids = tuple(engine.tokenizer.encode(PROMPT, add_special_tokens=False).ids)
    handles = [engine.submit(GenerationRequest(
        ids, SamplingParams(temperature=0.8, seed=s), max_tokens=budget,
        grammar=GrammarSpec(json_schema=RECORD, close_within_budget=closure))) for s in seeds]
    terminals = [h.wait(300) for h in handles]
    return [(h.stream.text(), t) for h, t in zip(handles, terminals, strict=True)]


def _valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), RECORD)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_l4_tight_budget_closes_valid_and_names_the_forced_close(engine: AsyncEngine) -> None:
    """L4: every admitted output validates and a forced one ends grammar_forced_close (a
    normal FINISHED end); the same requests without closure are cut (max_output_tokens)."""
    on = _run(engine, True, range(8), 36)
    off = _run(engine, False, range(8), 36)
    assert all(_valid(text) for text, _ in on), [t for t, _ in on]
    reasons = {t.finish_reason for _, t in on}
    assert reasons <= {FinishReason.GRAMMAR_FORCED_CLOSE, FinishReason.GRAMMAR_COMPLETE}
    assert FinishReason.GRAMMAR_FORCED_CLOSE in reasons
    assert all(t.state.value == "FINISHED" for _, t in on)
    assert all(t.usage.selected_tokens <= 36 for _, t in on)
    assert not all(_valid(text) for text, _ in off)  # NOTE: the feature is what makes it valid
    assert FinishReason.MAX_OUTPUT_TOKENS in {t.finish_reason for _, t in off}


def test_l4_budget_below_shortest_completion_is_refused(engine: AsyncEngine) -> None:
    ids = tuple(engine.tokenizer.encode(PROMPT, add_special_tokens=False).ids)
    with pytest.raises(InvalidRequestError) as err:
        engine.submit(GenerationRequest(ids, max_tokens=5, grammar=GrammarSpec(json_schema=RECORD)))
    assert err.value.field == "max_tokens"
    # closure off: the old behaviour, admitted (and cut)
    h = engine.submit(GenerationRequest(ids, max_tokens=5, grammar=GrammarSpec(
        json_schema=RECORD, close_within_budget=False)))
    assert h.wait(60).finish_reason is FinishReason.MAX_OUTPUT_TOKENS


def test_o1_forced_close_is_in_the_trace() -> None:
    sink = ListTraceSink()
    with AsyncEngine.from_model_dir(None, EngineConfig(max_num_seqs=4), trace=sink) as eng:
        ids = tuple(eng.tokenizer.encode(PROMPT, add_special_tokens=False).ids)
        h = eng.submit(GenerationRequest(ids, SamplingParams(temperature=0.8, seed=1),
                                         max_tokens=30, grammar=GrammarSpec(json_schema=RECORD),
                                         request_id="closing"))
        terminal = h.wait(120)
    kinds = sink.kinds("closing")
    assert terminal.finish_reason is FinishReason.GRAMMAR_FORCED_CLOSE
    assert kinds.count(GRAMMAR_FORCED) == 1
    assert kinds.index(GRAMMAR_FORCED) < kinds.index("terminal")


# -- the closing walk, for all prefixes (property, oracle: jsonschema) ----------------------
_TOK = tokenizers.Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
_LL = ll_tokenizer(_TOK, frozenset({0, 2}))
_GRAMMAR = grammar_source(GrammarSpec(json_schema=RECORD))
_text = st.text(alphabet=st.characters(codec="utf-8", exclude_characters='"\\'), max_size=8)


@given(name=_text, age=st.integers(-10**12, 10**12), tags=st.lists(_text, max_size=3),
       note=_text, cut=st.integers(0, 10**6))
def test_l4_every_prefix_has_a_closing_path_that_validates(
        name: str, age: int, tags: list[str], note: str, cut: int) -> None:
    """For all valid documents and all token prefixes of them, the closing walk finds a
    completion, the grammar accepts prefix + completion, and the result validates."""
    doc = json.dumps({"name": name, "age": age, "tags": tags, "note": note},
                     separators=(",", ":"), ensure_ascii=False)
    ids = _TOK.encode(doc, add_special_tokens=False).ids
    prefix = ids[: cut % (len(ids) + 1)]
    m = llg.LLMatcher(_LL, _GRAMMAR, log_level=0)
    if m.consume_tokens(prefix) is False or m.is_error():
        return  # NOTE: a non-canonical split the grammar's lexer refuses; not this property
    path = closing_path(m, _LL, byte_table(_LL))
    assert path is not None
    assert m.consume_tokens(list(path.tokens)) is not False and m.is_accepting()
    text = (_LL.decode_bytes(prefix) + path.text).decode()
    jsonschema.validate(json.loads(text), RECORD)


def test_l4_tokenizer_missing_bytes_is_walked_around() -> None:
    """A byte-level BPE trained without the full byte alphabet lacks most single-byte tokens:
    the walk still finds a completion made only of tokens the tokenizer has, which the grammar
    accepts and which validates (the bound needs realizable paths, not a complete alphabet)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"], show_progress=False)
    tok.train_from_iterator(['{"name": "ab", "age": 10, "tags": ["x"], "note": "hi"}'] * 10,
                            trainer)
    ll = ll_tokenizer(tok, frozenset({0}))
    table = byte_table(ll)
    assert not table.complete and byte_table(_LL).complete
    m = llg.LLMatcher(ll, _GRAMMAR, log_level=0)
    assert m.consume_tokens(tok.encode('{"name":"ab', add_special_tokens=False).ids)
    path = closing_path(m, ll, table)
    assert path is not None
    assert m.consume_tokens(list(path.tokens)) is not False and m.is_accepting()
    jsonschema.validate(json.loads('{"name":"ab' + path.text.decode()), RECORD)


# -- on the wire -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def live(engine: AsyncEngine) -> Iterator[LiveServer]:
    from coda.server.app import create_app

    server = LiveServer(create_app(engine, manage_engine=False)).start()
    yield server
    server.stop()


def test_l5_openai_wire_reads_stop_and_too_small_budget_is_400(live: LiveServer) -> None:
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "r", "schema": RECORD}}
    r = client.chat.completions.create(
        model="default_model", messages=[{"role": "user", "content": "JSON please"}],
        response_format=fmt, max_tokens=32, seed=2, temperature=0.8)
    choice = r.choices[0]
    coda = (choice.model_extra or {})["coda"]
    assert coda["finish_reason"] in ("grammar_forced_close", "grammar_complete")
    assert choice.finish_reason == "stop"
    assert _valid(choice.message.content or "")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="default_model", messages=[{"role": "user", "content": "JSON"}],
            response_format=fmt, max_tokens=4)
    assert err.value.body["param"] == "max_tokens"  # type: ignore[index]
