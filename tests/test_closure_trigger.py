"""An optional call starts only where it fits the budget (issue 13's closer with tools ``auto``;
SPEC L4, G1, K2, S1).

Under ``tool_choice: auto`` free text accepts at every byte, so text ending in ``<tool_c``
accepts too; the closer used to count its completion as empty, let the tag start late and then
end the request with the half-written tag as text. Now output ending inside the tag counts as
the call begun, so for every budget the output is a complete call or text with no tag start,
ending ``max_output_tokens`` when the budget runs out in text.

The model is scripted (:class:`ScriptRunner`: the default model's engine, tokenizer and
template, with logits that force the script's next token by output position), so the model
*wants* to open the call at a known position; everything else is the product.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import openai
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.engine.async_engine import AsyncEngine
from coda.engine.runner import ModelRunner, SeqChunk
from coda.engine.types import EngineConfig, GenerationRequest
from coda.finish import FinishReason
from coda.sampling import SamplingParams
from coda.server.tools import OPEN_TAG, grammar_for, openai_plan, split
from tests.conftest import LiveServer, examples
from tests.test_speculative import EAGER

EOS_ID = 2  # <|im_end|> (default model)
CITY = {"type": "object", "required": ["city"], "additionalProperties": False,
        "properties": {"city": {"type": "string"}}}
TOOLS: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
TEXT = "Let me check the weather for you. "
CALL = OPEN_TAG + '\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'


class ScriptRunner(ModelRunner):
    """Forces ``script[n]`` as output token ``n`` (EOS past the script). One request at a time:
    a chunk of several tokens is a prompt's last chunk and sets where the output starts."""

    def __init__(self, base: ModelRunner, script: Sequence[int]) -> None:
        super().__init__(base.model, num_blocks=base.num_blocks, block_size=base.block_size)
        self.script, self.start = list(script), 0

    def execute(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        ends: list[int] = []  # the sequence length each logits row follows
        for c in chunks:
            end = c.start_pos + len(c.token_ids)
            if c.need_logits and c.num_logits == 1 and len(c.token_ids) > 1:
                self.start = end  # NOTE: the prompt ends here: its logits give output token 0
            if c.need_logits:  # NOTE: a verification's rows follow its drafts (issue 21)
                ends += range(end - c.num_logits + 1, end + 1)
        logits = torch.zeros((len(ends), self.config.vocab_size), dtype=torch.float32)
        for i, end in enumerate(ends):
            n = end - self.start
            logits[i, self.script[n] if n < len(self.script) else EOS_ID] = 60.0
        return logits


def _engine(speculative: str = "off") -> AsyncEngine:
    engine = AsyncEngine.from_model_dir(None, EngineConfig(
        num_blocks=64, max_num_seqs=1, enable_prefix_caching=False, speculative=speculative))
    if engine.speculative is not None:
        engine.speculative = EAGER  # NOTE: every draft worth its row: many verified rows
    ids = engine.tokenizer.encode(TEXT + CALL, add_special_tokens=False).ids
    engine.runner = engine.core.runner = ScriptRunner(engine.runner, ids)
    engine.start()
    return engine


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncEngine]:
    eng = _engine()
    yield eng
    eng.shutdown()


def _script(engine: AsyncEngine) -> tuple[int, int]:
    """(tokens before the one that starts the tag, tokens in the whole script)."""
    runner = engine.runner
    assert isinstance(runner, ScriptRunner)
    pieces = [engine.tokenizer.decode([i]) for i in runner.script]
    text_len = next(n for n, p in enumerate(pieces) if "<" in p)
    return text_len, len(runner.script)


def _run(engine: AsyncEngine, budget: int, prompt: str = "What is the weather in Paris?",
         ) -> tuple[str, Any]:
    plan = openai_plan(TOOLS, "auto", None)
    assert plan is not None
    ids = tuple(engine.tokenizer.encode(prompt, add_special_tokens=False).ids)
    h = engine.submit(GenerationRequest(ids, SamplingParams(temperature=0), max_tokens=budget,
                                        grammar=grammar_for(plan)))
    terminal = h.wait(120)
    return h.stream.text(), terminal


def _honest(text: str, terminal: Any, budget: int, text_len: int) -> None:
    """The invariant (L4, K2): a complete call, or text with no tag start; an end that says
    why (the budget when the budget was used up in text)."""
    assert terminal.usage.selected_tokens <= budget
    rest, calls, _ = split(text)
    if calls:
        assert len(calls) == 1 and calls[0].name == "get_weather"
        assert set(json.loads(calls[0].arguments)) == {"city"}
        assert rest == TEXT and text.endswith("</tool_call>")
        assert terminal.finish_reason in (FinishReason.EOS, FinishReason.GRAMMAR_COMPLETE,
                                          FinishReason.GRAMMAR_FORCED_CLOSE) or (
            # NOTE: a call closed on the budget's last token (another could follow: L4)
            terminal.finish_reason is FinishReason.MAX_OUTPUT_TOKENS
            and terminal.usage.selected_tokens == budget)
        return
    assert "<" not in text, text  # NOTE: no tag start, not even its first byte
    assert TEXT.startswith(text)
    if budget <= text_len:  # NOTE: the budget ran out in the text: it names the end
        assert terminal.finish_reason is FinishReason.MAX_OUTPUT_TOKENS
    else:  # NOTE: the closer ended it where the call would have started (a natural end)
        assert terminal.finish_reason is FinishReason.GRAMMAR_FORCED_CLOSE
        assert terminal.usage.selected_tokens == text_len + 1


def test_l4_k2_tag_never_starts_when_the_call_cannot_fit(engine: AsyncEngine) -> None:
    """L4/K2: with room for the text but not for the call the output is the text alone, ended
    by the closer at the tag's position; with room for the whole script the call completes as
    scripted; a budget inside the text ends ``max_output_tokens``."""
    text_len, total = _script(engine)
    text, terminal = _run(engine, text_len + 10)
    assert text == TEXT.rstrip(" ") and "<" not in text
    assert terminal.finish_reason is FinishReason.GRAMMAR_FORCED_CLOSE
    assert terminal.usage.selected_tokens == text_len + 1  # NOTE: the text, then the end
    text, terminal = _run(engine, total + 5)
    assert text == TEXT + CALL
    assert split(text)[1][0].arguments == '{"city":"Paris"}'
    text, terminal = _run(engine, text_len - 2)
    assert terminal.finish_reason is FinishReason.MAX_OUTPUT_TOKENS and "<" not in text


@settings(deadline=None, max_examples=examples(30))
@given(extra=st.integers(-3, 52))  # NOTE: through the whole script (57 tokens)
def test_l4_g1_every_budget_gives_a_complete_call_or_no_tag(engine: AsyncEngine,
                                                            extra: int) -> None:
    """For all budgets from inside the text to past the script: a complete call, or text
    without a tag start; and once a budget yields a call every larger one does (the shortest call fits from
    the tag onwards)."""
    text_len, _ = _script(engine)
    budget = max(1, text_len + extra)
    text, terminal = _run(engine, budget)
    _honest(text, terminal, budget, text_len)
    if split(text)[1]:
        text, terminal = _run(engine, budget + 1)
        _honest(text, terminal, budget + 1, text_len)
        assert split(text)[1]


def test_t4_l4_tag_start_at_drafted_positions_equals_plain(engine: AsyncEngine) -> None:
    """T4, L4: with prompt lookup drafting the script (the prompt holds it) the closer judges
    the tag's start at drafted positions (``admits(..., ahead=j)``); for every budget around
    the tag the output, its end and its usage equal plain decoding's, and drafts were
    accepted."""
    text_len, total = _script(engine)
    prompt = f"Say: {TEXT}{CALL}"
    spec = _engine("prompt-lookup")
    accepted = 0
    try:
        for budget in range(text_len - 2, total + 3):
            want_text, want = _run(engine, budget, prompt)
            text, got = _run(spec, budget, prompt)
            assert (text, got.finish_reason, got.usage.selected_tokens) == \
                (want_text, want.finish_reason, want.usage.selected_tokens), budget
            _honest(text, got, budget, text_len)
            accepted += (got.speculative or {}).get("accepted", 0)
        assert accepted > 0
    finally:
        spec.shutdown()


# -- through the official client -----------------------------------------------------------
@pytest.fixture(scope="module")
def oa(engine: AsyncEngine) -> Iterator[openai.OpenAI]:
    from coda.server.app import create_app

    live = LiveServer(create_app(engine, manage_engine=False)).start()
    yield openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
    live.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_l4_openai_auto_call_starts_only_where_it_fits(oa: openai.OpenAI, stream: bool) -> None:
    """L4 on the wire: a budget too small for the call gives plain text (no ``<tool_call``,
    no tool_calls, ``stop``); a budget large enough gives the call (``tool_calls``)."""
    model = oa.models.list().data[0].id
    ask: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    for max_tokens, calls in ((20, False), (80, True)):
        args: list[str] = []  # the calls' arguments
        if stream:
            content, reason = "", None
            for chunk in oa.chat.completions.create(model=model, messages=ask, tools=TOOLS,
                                                    max_tokens=max_tokens, temperature=0,
                                                    stream=True):
                for ch in chunk.choices:
                    content += ch.delta.content or ""
                    args += [d.function.arguments or "" for d in ch.delta.tool_calls or []
                             if d.function is not None]
                    reason = ch.finish_reason or reason
        else:
            r = oa.chat.completions.create(model=model, messages=ask, tools=TOOLS,
                                           max_tokens=max_tokens, temperature=0)
            choice = r.choices[0]
            content, reason = choice.message.content or "", choice.finish_reason
            args = [c.function.arguments for c in choice.message.tool_calls or []
                    if c.type == "function"]
        assert "<" not in content, content
        if calls:
            assert reason == "tool_calls" and len(args) == 1
            assert json.loads(args[0]) == {"city": "Paris"}
        else:
            assert reason == "stop" and not args and content == TEXT.rstrip(" ")


def test_g1_forced_path_through_a_begun_tag_ends_only_when_whole(engine: AsyncEngine) -> None:
    """G1: forcing from output that ends inside the tag finishes the tag and the call, and the
    request ends ``grammar_forced_close`` only once the whole path is chosen (the half tag
    accepts as free text on the way)."""
    from coda.engine.closure import BudgetCloser
    from coda.engine.grammar import compile_grammar

    plan = openai_plan(TOOLS, "auto", None)
    assert plan is not None
    spec = grammar_for(plan)
    assert spec is not None
    gm = compile_grammar(spec, engine.tokenizer, engine.runner.config.vocab_size,
                         engine.eos_token_ids)
    closer = BudgetCloser(gm, 100)
    for i in engine.tokenizer.encode("Hi <to", add_special_tokens=False).ids:
        assert gm.consume(i)
    path = closer.force()
    assert path is not None and path.text.startswith(b"ol_call>\n{")
    for t in path.tokens[:-1]:
        assert gm.consume(t) and not closer.done()
    assert gm.consume(path.tokens[-1])
    assert closer.done() is FinishReason.GRAMMAR_FORCED_CLOSE
    assert split("Hi <to" + path.text.decode())[1][0].name == "get_weather"
