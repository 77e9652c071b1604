"""The early-stop policy inside the real engine loop (issue 5 item 2; SPEC D1, D2, D6, G1, L4).

The hook runs last among the per-token checks (G1); its decisions become finish reasons
(confidence_stop is finish-reason version 2, L4); a user cancel goes through the cancel path (D6).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from coda.early_stop import EarlyStopController, EarlyStopPolicy
from coda.engine.async_engine import AsyncEngine, RequestHandle
from coda.engine.early_stop_hook import ConfidenceSignal, make_hook
from coda.engine.grammar import compile_grammar
from coda.engine.types import EngineConfig, GenerationRequest, GrammarSpec
from coda.finish import FinishReason
from coda.lifecycle import State
from coda.sampling import SamplingParams
from tests.random_checkpoint import make_random_checkpoint

PROMPT = (21, 22, 23, 24)
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                   "c": {"enum": ["red", "green"]}},
    "required": ["n", "c"],
    "additionalProperties": False,
}


def policy(**kw: object) -> EarlyStopPolicy:
    base: dict[str, object] = dict(min_tokens=0, max_tokens=1000, deadline_ms=600_000,
                                   confidence_threshold=1.0, no_retry_after_first_frame=True)
    return EarlyStopPolicy(**{**base, **kw})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_checkpoint(
        tmp_path_factory.mktemp("early"), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[AsyncEngine]:
    eng = AsyncEngine.from_model_dir(model_dir, EngineConfig(num_blocks=256))
    eng.start()
    yield eng
    eng.shutdown()


# Random text can end inside a UTF-8 character (K3: FAILED at drain); this always-accepting
# grammar keeps it ASCII so every finish reason is exact. It never completes before 500 chars.
ASCII = GrammarSpec(regex=r"[a-z ]{0,500}")


def submit(engine: AsyncEngine, pol: EarlyStopPolicy, *, seed: int = 0, max_tokens: int = 64,
           grammar: GrammarSpec | None = ASCII) -> RequestHandle:
    # NOTE: min_tokens bans EOS (allowed by the ASCII grammar) until the request's own limit
    ban_eos = max_tokens if grammar is ASCII or grammar is None else 0
    return engine.submit(GenerationRequest(
        PROMPT, SamplingParams(seed=seed, min_tokens=ban_eos),
        max_tokens=max_tokens, early_stop=pol, grammar=grammar))


def summary(h: RequestHandle) -> dict[str, object]:
    return h._run.early_stop_summary  # type: ignore[attr-defined, no-any-return]


# -- on the engine ----------------------------------------------------------------------------
def test_d2_l4_confidence_stop_at_min_tokens(engine: AsyncEngine) -> None:
    """D2: threshold 0 and min_tokens 3 stop at exactly 3 tokens with CONFIDENCE_STOP (L4 v2),
    on the cancel path (D6: CANCELLED); committed tokens and the saved upper bound are kept."""
    for seed in range(4):
        h = submit(engine, policy(min_tokens=3, max_tokens=50, confidence_threshold=0.0), seed=seed)
        term = h.wait(30)
        assert term.state is State.CANCELLED
        assert term.finish_reason is FinishReason.CONFIDENCE_STOP
        assert term.usage.selected_tokens == 3
        s = summary(h)
        assert s["reason"] == "confidence" and s["stopped"] is True
        assert s["committed_tokens"] == 3 and s["saved_tokens_upper_bound"] == 47


def test_d2_policy_max_tokens_is_max_output_tokens(engine: AsyncEngine) -> None:
    """D2 max-tokens (hard budget) -> MAX_OUTPUT_TOKENS, well before the request's own limit."""
    h = submit(engine, policy(max_tokens=5), max_tokens=40)
    term = h.wait(30)
    assert term.usage.selected_tokens == 5
    assert summary(h)["reason"] == "max-tokens" and summary(h)["saved_tokens_upper_bound"] == 0
    assert term.finish_reason is FinishReason.MAX_OUTPUT_TOKENS
    assert term.state is State.CANCELLED  # D6: the policy's own stop is a cancel


def test_d2_g3_deadline_beats_confidence(model_dir: Path) -> None:
    """D2 precedence: a passed deadline wins over a ready confidence stop; the deadline is
    measured from the run's arrival (submit), so a request queued behind a 48-token request
    (one sequence at a time) is past a 5 ms budget at its first token. G3: reported as
    deadline_exceeded."""
    eng = AsyncEngine.from_model_dir(model_dir, EngineConfig(num_blocks=64, max_num_seqs=1))
    try:
        eng.start()
        blocker = eng.submit(GenerationRequest(PROMPT, SamplingParams(seed=0, min_tokens=48),
                                               max_tokens=48))
        h = submit(eng, policy(deadline_ms=5, confidence_threshold=0.0), max_tokens=20)
        term = h.wait(30)
        assert blocker.wait(30).usage.selected_tokens == 48
    finally:
        eng.shutdown()
    assert term.usage.selected_tokens == 1
    assert summary(h)["reason"] == "deadline"
    assert term.finish_reason is FinishReason.DEADLINE_EXCEEDED


def test_d1_require_closure_waits_for_closed_json(engine: AsyncEngine) -> None:
    """D1 requireClosure: with a JSON grammar a confidence stop cannot cut the object; the run
    ends only once it closed (grammar_complete, G1) and the JSON validates. Without the rule
    the same policy stops after 1 token."""
    for seed in range(5):
        spec = GrammarSpec(json_schema=SCHEMA)
        h = submit(engine, policy(min_tokens=1, confidence_threshold=0.0, require_closure=True),
                   seed=seed, max_tokens=100, grammar=spec)
        assert h.wait(30).finish_reason is FinishReason.GRAMMAR_COMPLETE
        jsonschema.validate(json.loads(h.stream.text()), SCHEMA)
        h = submit(engine, policy(min_tokens=1, confidence_threshold=0.0), seed=seed,
                   max_tokens=100, grammar=spec)
        term = h.wait(30)
        assert term.finish_reason is FinishReason.CONFIDENCE_STOP
        assert term.usage.selected_tokens == 1


def test_d1_require_closure_stops_at_first_accepting_token(engine: AsyncEngine,
                                                           model_dir: Path) -> None:
    """D1 requireClosure with a grammar that may continue after accepting: the confidence stop
    comes on the first token after which the output is a complete sentence, not before."""
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    pattern = r"[a-z]{4,40}"
    for seed in range(5):
        h = submit(engine, policy(min_tokens=1, confidence_threshold=0.0, require_closure=True),
                   seed=seed, max_tokens=60, grammar=GrammarSpec(regex=pattern))
        term = h.wait(30)
        assert term.finish_reason is FinishReason.CONFIDENCE_STOP, h.stream.text()
        assert re.fullmatch(pattern, h.stream.text())
        ids = [t.token_id for ev in h.stream.events_after(-1) for t in ev.tokens]
        ids += [t.token_id for t in term.trailing_tokens]
        replay = compile_grammar(GrammarSpec(regex=pattern), tok, 2560, engine.eos_token_ids)
        for tid in ids[:-1]:
            assert replay.consume(tid) and not replay.is_accepting()
        assert replay.consume(ids[-1]) and replay.is_closed


def test_d1_require_closure_without_grammar_never_confident(engine: AsyncEngine) -> None:
    """Documented choice: no grammar = never closed, so only the budget can stop it.
    The budget stop is a cancel (D6): free random text cut inside a UTF-8 character is not
    drained, so it never ends FAILED (K3)."""
    h = submit(engine, policy(max_tokens=6, confidence_threshold=0.0, require_closure=True),
               max_tokens=30, grammar=None)
    term = h.wait(30)
    assert term.usage.selected_tokens == 6 and summary(h)["reason"] == "max-tokens"
    # D6: the policy's budget stop takes the cancel path, so a cut character never fails it
    assert term.state is State.CANCELLED
    assert term.finish_reason is FinishReason.MAX_OUTPUT_TOKENS


# -- the hook alone ---------------------------------------------------------------------------
ARRIVAL = 100.0


def test_confidence_signal_is_a_windowed_mean() -> None:
    """The documented signal: mean of the last `window` probabilities; window 1 = raw."""
    probs = [0.9, 0.1, 0.9, 0.9, 0.9, 0.9]

    def stop_at(signal: ConfidenceSignal) -> int | None:
        ctl = EarlyStopController(policy(min_tokens=2, confidence_threshold=0.8))
        hook = make_hook(ctl, ARRIVAL, None, signal=signal, clock=lambda: 100.0)
        for t, p in enumerate(probs, start=1):
            if hook(t, p).reason is FinishReason.CONFIDENCE_STOP:
                return t
        return None

    assert stop_at(ConfidenceSignal(window=1)) == 3
    assert stop_at(ConfidenceSignal()) == 6  # (0.1 + 0.9*3)/4 = 0.7 at t=5; 0.9 at t=6
    push = ConfidenceSignal(window=2).tracker()
    assert [push(p) for p in (float("nan"), 1.0000001, 0.5)] == [0.0, 0.5, 0.75]
    for bad in (0, -1, True):
        with pytest.raises(ValueError):
            ConfidenceSignal(window=bad)  # type: ignore[arg-type]


def test_d6_user_cancel_is_a_decision_not_a_call_back_up() -> None:
    """D6, issue 11 item 2: a user-cancel decision is returned as a verdict (reason
    ``cancelled``) that the core takes down the cancel path; the hook touches no run."""
    ctl = EarlyStopController(policy(confidence_threshold=0.0))
    hook = make_hook(ctl, ARRIVAL, None, clock=lambda: 100.0)
    ctl.cancel()
    verdict = hook(1, 0.5)
    assert verdict.reason is FinishReason.CANCELLED
    assert verdict.summary["reason"] == "user-cancel"


def test_deadline_is_measured_from_arrival() -> None:
    ctl = EarlyStopController(policy(deadline_ms=250))
    now = [100.2]
    hook = make_hook(ctl, ARRIVAL, None, clock=lambda: now[0])
    assert hook(1, 0.5).reason is None and ctl.state.elapsed_ms == 200
    now[0] = 100.25
    assert hook(2, 0.5).reason is FinishReason.DEADLINE_EXCEEDED
    assert hook(3, 0.5).reason is FinishReason.DEADLINE_EXCEEDED  # D2: the first stop is final
    assert ctl.state.tokens == 2
