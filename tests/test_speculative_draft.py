"""Exact draft-model speculative decoding (issue 21 item 2; SPEC T1, T3, T4, L6, L7, O1, P2).

The oracle is plain decoding on the target: tokens, logprobs (and top logprobs), text, finish
reason and usage must be identical with a draft model and without — greedy and seeded T = 0.8,
alone, in a crowd of 16, after preemption, streamed through the ``openai`` client — and the
target's and the draft's KV blocks must all be free afterwards. Two drafts of the tiny random
target: itself (the degenerate check: every greedy draft is accepted, and with the same draw
every seeded one too) and the target cut to its first 3 layers (a real pair: drafts are both
accepted and rejected, so the rollback of the draft's cache is exercised). SmolLM2 drafts for
itself and for the 30-layer SmolLM2 as a cut of 12 layers (GGUF, the stored Q4_1 rows kept).
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from coda import trace as tr
from coda.engine.async_engine import AsyncEngine
from coda.engine.draft_load import speculative_mode
from coda.engine.speculative import SpeculativeConfig
from coda.engine.types import EngineConfig, GenerationRequest
from coda.sampling import SamplingParams
from coda.trace import ListTraceSink
from tests.conftest import LiveServer, examples
from tests.draft_fixtures import cut_gguf, cut_hf
from tests.engine_support import trace_problems_once_settled
from tests.plain_memo import plain_run
from tests.test_speculative import (
    _PARAMS,
    Result,
    _run,
    _streamed,
    alternate_sampling,
    prefix_cache_runs_equal_plain,
)

# NOTE: as eager as possible (every draft worth its row), so exactness is tested on many rows
EAGER = SpeculativeConfig(step_rows=1e9, k_max=5)


def _engine(model: Path | str, draft: Path | str | None, sink: ListTraceSink | None = None,
            **cfg: Any) -> AsyncEngine:
    cfg.setdefault("num_blocks", 256)
    cfg.setdefault("enable_prefix_caching", False)
    engine = AsyncEngine.from_model_dir(model, EngineConfig(
        draft_model=str(draft) if draft is not None else None, max_stop_strings=4, **cfg),
        trace=sink)
    if engine.speculative is not None:
        engine.speculative = EAGER
    if engine.drafter is not None:
        engine.drafter.costs = None  # NOTE: unpriced: the cap (EAGER's k_max) every step
    engine.start()
    return engine


def _settled(engine: AsyncEngine) -> bool:
    """L7: idle, every target block and every draft block free, no draft state left."""
    end = time.monotonic() + 10
    while time.monotonic() < end:
        s, d = engine.stats(), engine.drafter
        if (s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_blocks
                and (d is None or (d.blocks.num_free_blocks == d.blocks.num_blocks
                                   and d.num_live == 0))):
            engine.core.scheduler.block_manager.check_integrity()
            if d is not None:
                d.blocks.check_integrity()
            return True
        time.sleep(0.02)
    return False


def _requests(n: int, vocab: int, seed: int = 0, max_tokens: int = 32) -> list[GenerationRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        sampling = alternate_sampling(i, rng)
        prompt = tuple(rng.randrange(40, vocab) for _ in range(rng.randint(3, 40)))
        out.append(GenerationRequest(prompt, sampling, max_tokens=max_tokens, utf8_tail="drop"))
    return out


def _same(got: Sequence[Result], want: Sequence[Result]) -> None:
    assert [(g.signature, g.text, g.finish_reason, g.usage) for g in got] == \
        [(w.signature, w.text, w.finish_reason, w.usage) for w in want]


def _counts(results: Sequence[Result]) -> tuple[int, int]:
    """(accepted, rejected) over ``results``."""
    return (sum((r.speculative or {}).get("accepted", 0) for r in results),
            sum((r.speculative or {}).get("rejected", 0) for r in results))


@pytest.fixture(scope="module")
def pair(server_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny target cut to its first 3 of 4 layers (an HF folder, same tokenizer)."""
    return cut_hf(server_checkpoint, tmp_path_factory.mktemp("draft") / "cut3", 3)


@pytest.fixture(scope="module")
def plain(server_checkpoint: Path) -> Iterator[AsyncEngine]:
    engine = _engine(server_checkpoint, None)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("which", ["self", "cut"])
def test_t4_draft_model_outputs_equal_plain_decoding_alone_and_in_a_crowd(
        server_checkpoint: Path, pair: Path, plain: AsyncEngine, which: str) -> None:
    """T4, L6, L7, O1: with the target itself or its 3-layer cut as the draft, greedy and
    seeded T = 0.8 requests give plain decoding's tokens, logprobs, text, finish reason and
    usage, alone and in a crowd of 16; the self-draft accepts every draft (same draw), the cut
    accepts some and rejects some; every target and draft block is free after; the trace is
    one the engine could write."""
    sink = ListTraceSink()
    spec = _engine(server_checkpoint, server_checkpoint if which == "self" else pair, sink)
    try:
        reqs = _requests(16, plain.limits.vocab_size)
        want = plain_run(plain, reqs, crowd=False)
        for crowd in (False, True):
            got = _run(spec, reqs, crowd=crowd)
            _same(got, want)
            accepted, rejected = _counts(got)
            if which == "self":
                assert accepted > 0 and rejected == 0, "a model drafting for itself agrees"
            else:
                assert accepted > 0 and rejected > 0, "the pair must accept and reject"
        assert _settled(spec)
        assert trace_problems_once_settled(sink) == []
        assert any(e.kind == tr.SPECULATIVE for e in sink.events)
    finally:
        spec.shutdown()


def test_t4_l7_draft_model_after_preemption_equals_plain(server_checkpoint: Path, pair: Path,
                                                         plain: AsyncEngine) -> None:
    """T4, L7: a cache too small for the crowd preempts while drafts are verified; the
    preempted requests' draft state is dropped and rebuilt; outputs stay plain decoding's and
    every target and draft block comes back."""
    reqs = _requests(8, plain.limits.vocab_size, seed=3, max_tokens=40)
    want = plain_run(plain, reqs, crowd=False)
    small = _engine(server_checkpoint, pair, num_blocks=14)
    try:
        got = _run(small, reqs)
        assert small.core.num_preemptions_total > 0
        _same(got, want)
        assert sum(_counts(got)) > 0
        assert _settled(small)
    finally:
        small.shutdown()


def test_l7_draft_model_prefix_cache_holds_only_accepted_tokens(
        server_checkpoint: Path, pair: Path, plain: AsyncEngine) -> None:
    """L7, T4: with the target's prefix cache on, no cached block holds a rejected draft
    (every cached block is a block of some request's prompt + output); a second run hits the
    cache and both runs equal plain decoding."""
    reqs = _requests(6, plain.limits.vocab_size, seed=11, max_tokens=40)
    want = plain_run(plain, reqs)
    cached = _engine(server_checkpoint, pair, enable_prefix_caching=True)
    try:
        assert all(n > 0 for n in _counts(prefix_cache_runs_equal_plain(cached, reqs, want)))
    finally:
        cached.shutdown()


def test_l7_draft_cache_follows_the_accepted_tokens(server_checkpoint: Path, pair: Path) -> None:
    """L7: between steps, each draft sequence's cached tokens are a prefix of its target
    sequence's tokens (the rejected tail was rolled back), never past them."""
    engine = _engine(server_checkpoint, pair)
    try:
        drafter = engine.drafter
        assert drafter is not None
        seen: list[bool] = []
        step = engine.core.step

        def checked_step() -> int:
            n = step()
            for sid, d in drafter._seqs.items():
                req = engine.core.requests.get(sid)
                if req is not None:
                    mine = d.prompt_token_ids[:d.num_computed_tokens]
                    seen.append(mine == req.all_token_ids[:len(mine)])
            return n

        engine.core.step = checked_step  # type: ignore[method-assign]
        _run(engine, _requests(6, engine.limits.vocab_size, seed=5))
        assert seen and all(seen)
        assert _settled(engine)
    finally:
        engine.shutdown()


def test_a_failing_draft_forward_only_means_no_drafts(server_checkpoint: Path, pair: Path,
                                                      plain: AsyncEngine) -> None:
    """A draft forward that raises (every third one here) costs that step its drafts, never a
    request: the draft state is dropped and rebuilt, the outputs equal plain decoding's and
    every target and draft block is free after."""
    reqs = _requests(6, plain.limits.vocab_size, seed=7)
    want = plain_run(plain, reqs, crowd=False)
    spec = _engine(server_checkpoint, pair)
    try:
        assert spec.drafter is not None
        real, calls = spec.drafter.runner.execute, itertools.count()

        def flaky(chunks: Any) -> Any:
            if next(calls) % 3 == 1:
                raise RuntimeError("draft forward failed")
            return real(chunks)

        spec.drafter.runner.execute = flaky  # type: ignore[method-assign]
        got = _run(spec, reqs)
        _same(got, want)
        assert sum(_counts(got)) > 0 and next(calls) > 3
        assert _settled(spec)
    finally:
        spec.shutdown()


@pytest.fixture(scope="module")
def cut_engine(server_checkpoint: Path, pair: Path) -> Iterator[AsyncEngine]:
    engine = _engine(server_checkpoint, pair)
    yield engine
    engine.shutdown()


@settings(max_examples=examples(10), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(params=_PARAMS, prompt=st.lists(st.integers(40, 200), min_size=1, max_size=30),
       max_tokens=st.integers(1, 40),
       stop=st.one_of(st.none(), st.text(alphabet="abcdefgh ", min_size=1, max_size=3)),
       ignore_eos=st.booleans(), crowd=st.integers(1, 4))
def test_property_draft_model_equals_plain_decoding(
        plain: AsyncEngine, cut_engine: AsyncEngine, params: dict[str, Any], prompt: list[int],
        max_tokens: int, stop: str | None, ignore_eos: bool, crowd: int) -> None:
    """For all prompts, sampling settings (penalties, min_tokens, top-k/p, seeds), budgets,
    stop strings and crowd sizes: drafting with the cut model gives plain decoding's outcome
    (T4, L6), and the target's and the draft's blocks all come back (L7)."""
    sampling = SamplingParams(logprobs=1, ignore_eos=ignore_eos, **params)
    max_tokens = max(max_tokens, params["min_tokens"])  # NOTE: below it: a 400 (L4)
    reqs = [GenerationRequest(tuple(prompt) + (40 + i,), sampling, max_tokens=max_tokens,
                              stop=(stop,) if stop and stop.strip() else (), utf8_tail="drop")
            for i in range(crowd)]
    _same(_run(cut_engine, reqs), plain_run(plain, reqs))
    assert _settled(cut_engine)


def test_draft_model_with_another_vocabulary_is_refused_at_start(server_checkpoint: Path) -> None:
    """A draft whose tokenizer differs from the target's (the embedded model's 4096-token
    vocabulary against the tiny model's) is refused before anything is served, saying why."""
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        AsyncEngine.from_model_dir(server_checkpoint, EngineConfig(
            num_blocks=64, draft_model=str(Path("coda/assets/default_model").resolve())))


def test_speculative_mode_from_the_flags() -> None:
    """--draft-model implies draft; draft without a model, or with prompt-lookup, is refused."""
    assert speculative_mode("off", "m") == "draft"
    assert speculative_mode("draft", "m") == "draft"
    assert speculative_mode("prompt-lookup", None) == "prompt-lookup"
    with pytest.raises(ValueError, match="needs --draft-model"):
        speculative_mode("draft", None)
    with pytest.raises(ValueError, match="give one of them"):
        speculative_mode("prompt-lookup", "m")


def test_cli_speculative_draft_without_a_model_exits_2() -> None:
    """`coda serve --speculative draft` without --draft-model: refused before any load; so is
    a draft for several models (it shares one target's tokenizer)."""
    from coda.cli import app

    result = CliRunner().invoke(app, ["serve", "--port", "0", "--speculative", "draft"])
    assert result.exit_code == 2
    assert "needs --draft-model" in result.output
    result = CliRunner().invoke(app, ["serve", "--port", "0", "--model", "a", "--model", "b",
                                      "--draft-model", "c"])
    assert result.exit_code == 2
    assert "not supported with several models" in result.output


# -------------------------------------------------------------------- the live server, streamed
MSG = [{"role": "user", "content": "abc abc abc abc abc abc abc abc abc abc"}]


def _live(engine: AsyncEngine) -> LiveServer:
    from coda.server.app import create_app
    from coda.server.state import ServerSettings

    return LiveServer(create_app(engine, settings=ServerSettings(keepalive_s=0.5),
                                 manage_engine=False)).start()


def _chat_streamed(client: openai.OpenAI, **kw: Any) -> tuple[str, list[Any], str, Any, Any]:
    text, logprobs, reason, usage, coda = "", [], "", None, {}
    for chunk in client.chat.completions.create(
            model="tiny-chat", messages=MSG, max_tokens=40, logprobs=True, top_logprobs=2,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True}, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.logprobs is not None and c.logprobs.content:
                logprobs += [x.model_dump() for x in c.logprobs.content]
            reason = c.finish_reason or reason
        usage = chunk.usage or usage
        coda = (chunk.model_extra or {}).get("coda") or coda  # NOTE: on the last chunk
    return text, logprobs, reason, usage.model_dump() if usage else None, coda


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 5}])
def test_p2_t4_draft_model_server_streams_what_the_plain_server_streams(
        plain: AsyncEngine, cut_engine: AsyncEngine, sampling: dict[str, Any]) -> None:
    """P2, T4, L6: streamed chat through the openai client: the draft server's text,
    logprobs, finish reason and usage equal the plain server's; its last chunk reports the
    drafts (``coda.speculative``)."""
    spec = cut_engine  # NOTE: the target drafted for by its cut, as the property test's
    plain_live, spec_live = _live(plain), _live(spec)
    try:
        clients = [openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
                   for s in (plain_live, spec_live)]
        want, got = (_chat_streamed(c, **sampling) for c in clients)
        assert got[:4] == want[:4]
        assert got[4]["speculative"]["drafted"] > 0
        assert _settled(spec)
    finally:
        spec_live.stop()
        plain_live.stop()


# ------------------------------------------------------------------------- SmolLM2 (real model)
@pytest.fixture(scope="module")
def smollm_cut(smollm_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M cut to its first 12 of 30 blocks (GGUF, Q4_1 rows as stored)."""
    return cut_gguf(smollm_gguf, tmp_path_factory.mktemp("smol") / "smollm2-cut12.gguf", 12)


SMOLLM_KW: dict[str, Any] = {"num_blocks": 96, "max_model_len": 512}


@pytest.fixture(scope="module")
def smollm_plain(smollm_gguf: Path) -> Iterator[AsyncEngine]:
    """SmolLM2 decoding plainly: the reference of both drafts (its runs memoised, plain_memo)."""
    engine = _engine(smollm_gguf, None, **SMOLLM_KW)
    yield engine
    engine.shutdown()


def _chat_ids(engine: AsyncEngine, text: str) -> tuple[int, ...]:
    prompt = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return tuple(engine.tokenizer.encode(prompt).ids)


@pytest.mark.parametrize("which", ["self", "cut"])
def test_t4_smollm2_draft_model_is_byte_identical(smollm_gguf: Path, smollm_cut: Path,
                                                  smollm_plain: AsyncEngine, which: str) -> None:
    """T4, L6 on the real model (packed, batch-invariant): SmolLM2 drafting for itself
    accepts every greedy draft (the degenerate check) and the 12-block cut drafts for the
    full model; greedy and seeded T = 0.8, alone and streamed in a crowd, give plain
    decoding's text, tokens, logprobs, finish reason and usage; all blocks free after."""
    plain = smollm_plain
    spec = _engine(smollm_gguf, smollm_gguf if which == "self" else smollm_cut, **SMOLLM_KW)
    try:
        ids = _chat_ids(plain, "List the days of the week, one per line.")
        ids2 = _chat_ids(plain, "Write a Python function that adds two numbers.")
        reqs = [GenerationRequest(ids, SamplingParams(temperature=0.0, logprobs=2),
                                  max_tokens=24),
                GenerationRequest(ids2, SamplingParams(temperature=0.8, seed=3, logprobs=2),
                                  max_tokens=24),
                GenerationRequest(ids2, SamplingParams(temperature=0.0, logprobs=2),
                                  max_tokens=24)]
        want = plain_run(plain, reqs, crowd=False)
        got_alone = _run(spec, reqs, crowd=False)
        got_crowd = _streamed(spec, reqs)
        for got in (got_alone, got_crowd):
            _same(got, want)
        greedy = [got_alone[0], got_alone[2]]
        accepted, rejected = _counts(greedy)
        assert accepted > 0
        if which == "self":
            assert rejected == 0, "SmolLM2 drafting for itself must agree on every greedy draft"
        assert _settled(spec)
    finally:
        spec.shutdown()
