"""`coda serve --speculative prompt-lookup` through the real HTTP server and the official
clients (issue 21; SPEC T4, L6, P2, O1): streamed and non-streamed chat, greedy and seeded
T = 0.8, give the plain server's bytes, logprobs, finish reason and usage; the final chunk's
``coda.speculative`` reports what was drafted; ``speculative: false`` (a Coda extension, in
every protocol) opts a request out; the CLI flag reaches the engine and an unknown mode exits 2.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from typer.testing import CliRunner

from coda.engine.async_engine import AsyncEngine
from coda.engine.types import EngineConfig
from tests.conftest import LiveServer
from tests.test_speculative import EAGER

MODEL = "tiny-chat"
# NOTE: a copy-heavy message: the tiny model's continuation repeats, so drafts are accepted
MSG = [{"role": "user", "content": "abc abc abc abc abc abc abc abc abc abc"}]


def _live(checkpoint: Path, speculative: str) -> tuple[AsyncEngine, LiveServer]:
    from coda.server.app import create_app
    from coda.server.state import ServerSettings

    engine = AsyncEngine.from_model_dir(checkpoint, EngineConfig(
        num_blocks=256, default_max_tokens=48, enable_prefix_caching=False,
        speculative=speculative))
    engine.start()
    live = LiveServer(create_app(engine, settings=ServerSettings(keepalive_s=0.5),
                                 manage_engine=False)).start()
    return engine, live


@pytest.fixture(scope="module")
def servers(server_checkpoint: Path) -> Iterator[tuple[openai.OpenAI, openai.OpenAI, str]]:
    plain_engine, plain = _live(server_checkpoint, "off")
    spec_engine, spec = _live(server_checkpoint, "prompt-lookup")
    yield (openai.OpenAI(base_url=plain.url + "/v1", api_key="x", max_retries=0),
           openai.OpenAI(base_url=spec.url + "/v1", api_key="x", max_retries=0), spec.url)
    for live, engine in ((plain, plain_engine), (spec, spec_engine)):
        live.stop()
        engine.shutdown()


def _chat(client: openai.OpenAI, **kw: Any) -> tuple[str, Any, str, dict[str, Any]]:
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=40, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True,
                                                                   **kw.pop("extra", {})}, **kw)
    c = r.choices[0]
    return c.message.content or "", c.logprobs.model_dump(), c.finish_reason, \
        c.model_extra["coda"]


def _chat_streamed(client: openai.OpenAI, **kw: Any) -> tuple[str, list[Any], str, dict[str, Any]]:
    text, logprobs, reason, coda = "", [], "", {}
    for chunk in client.chat.completions.create(
            model=MODEL, messages=MSG, max_tokens=40, logprobs=True, top_logprobs=2,
            stream=True, extra_body={"ignore_eos": True}, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.logprobs is not None and c.logprobs.content:
                logprobs += [x.model_dump() for x in c.logprobs.content]
            reason = c.finish_reason or reason
        coda = (chunk.model_extra or {}).get("coda") or coda  # NOTE: on the last chunk
    return text, logprobs, reason, coda


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 5}])
def test_t4_l6_speculative_server_answers_what_the_plain_server_answers(
        servers: Any, sampling: dict[str, Any]) -> None:
    """Greedy and seeded T = 0.8, streamed and not: same text, logprobs, finish reason and
    usage as the plain server; ``coda.speculative`` counts add up (O1)."""
    plain, spec, _ = servers
    for call in (_chat, _chat_streamed):
        want, got = call(plain, **sampling), call(spec, **sampling)
        assert got[:3] == want[:3]
        assert got[3]["usage"] == want[3]["usage"]
        assert "speculative" not in want[3]
        counts = got[3]["speculative"]
        assert counts["drafted"] == counts["accepted"] + counts["rejected"]
    if sampling["temperature"] == 0:
        assert counts["accepted"] > 0, "the copy-heavy chat accepted no draft"


def test_speculative_false_opts_a_request_out_in_every_protocol(servers: Any) -> None:
    """The `speculative: false` extension: no drafting (no ``coda.speculative``), same output;
    the Anthropic Messages API accepts it too (a Coda extension on every endpoint)."""
    plain, spec, url = servers
    got = _chat(spec, temperature=0, extra={"speculative": False})
    want = _chat(plain, temperature=0)
    assert "speculative" not in got[3] and got[:3] == want[:3]
    claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    on = claude.messages.create(model=MODEL, max_tokens=24, messages=MSG,
                                extra_body={"temperature": 0})
    off = claude.messages.create(model=MODEL, max_tokens=24, messages=MSG,
                                 extra_body={"temperature": 0, "speculative": False})
    assert on.content == off.content
    assert "speculative" in on.model_extra["coda"]
    assert "speculative" not in off.model_extra["coda"]
    with pytest.raises(openai.BadRequestError):
        spec.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2,
                                     extra_body={"speculative": "maybe"})


def test_cli_unknown_speculative_mode_exits_2(monkeypatch: pytest.MonkeyPatch) -> None:
    """`coda serve --speculative eagle`: refused with the reason before any model loads."""
    from coda.cli import app

    result = CliRunner().invoke(app, ["serve", "--port", "0", "--speculative", "eagle"])
    assert result.exit_code == 2
    assert "unknown --speculative 'eagle'" in result.output


# -- a tool call (grammar + budget closer) through the server, on the embedded default model --
CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
        '</tool_call>')
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]


@pytest.fixture(scope="module")
def tool_servers() -> Iterator[tuple[openai.OpenAI, openai.OpenAI]]:
    from coda.engine.async_engine import DEFAULT_MODEL_DIR

    plain_engine, plain = _live(DEFAULT_MODEL_DIR, "off")
    spec_engine, spec = _live(DEFAULT_MODEL_DIR, "prompt-lookup")
    spec_engine.speculative = EAGER  # NOTE: every draft worth its row: many verified rows
    yield (openai.OpenAI(base_url=plain.url + "/v1", api_key="x", max_retries=0),
           openai.OpenAI(base_url=spec.url + "/v1", api_key="x", max_retries=0))
    for live, engine in ((plain, plain_engine), (spec, spec_engine)):
        live.stop()
        engine.shutdown()


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 7}])
def test_t4_s1_tool_call_through_the_speculative_server_equals_plain(
        tool_servers: Any, sampling: dict[str, Any]) -> None:
    """T4, S1, L6: ``tools`` with ``tool_choice: required`` (a grammar with the budget closer)
    through the official client: the speculative server returns the plain server's tool call,
    logprobs, finish reason and usage, and drafts were accepted under the grammar."""
    plain, spec = tool_servers
    msg = [{"role": "user", "content": f"Call the tool exactly like this: {CALL} {CALL}"}]

    def call(client: openai.OpenAI) -> tuple[Any, ...]:
        c = client.chat.completions.create(
            model="default_model", messages=msg, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, max_tokens=60, logprobs=True, top_logprobs=2,
            **sampling).choices[0]
        calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        return calls, c.logprobs.model_dump() if c.logprobs else None, c.finish_reason, \
            c.model_extra["coda"]

    want, got = call(plain), call(spec)
    assert want[0] and got[:3] == want[:3]
    assert got[3]["usage"] == want[3]["usage"] and got[3]["finish_reason"] == \
        want[3]["finish_reason"]
    counts = got[3]["speculative"]
    assert counts["accepted"] > 0, counts
