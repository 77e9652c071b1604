"""A scripted model on the real engine and server, for wire tests of exact endings
(issue 8 defects 4 and 7, the ``utf8_tail`` extension).

:class:`ScriptedRunner` keeps the default model's configuration, KV cache and tokenizer but
answers every step with logits that force the next token of a chain keyed on the last input
token, so a request's output is exactly scripted: ``x`` → ``0xC3`` (a lone UTF-8 lead byte) →
EOS by default. Everything else (scheduler, sampler, detokenizer, stops, lifecycle, HTTP
routes, SSE) is the product.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from coda.engine.async_engine import DEFAULT_MODEL_DIR, AsyncEngine
from coda.engine.runner import ModelRunner, SeqChunk
from coda.engine.types import EngineConfig
from tests.conftest import LiveServer

X_ID, C3_ID, EOS_ID = 90, 130, 2   # "x", the byte 0xC3 alone, <|im_end|> (default model)
LEAD_BYTE_SCRIPT: Mapping[int, int] = {X_ID: C3_ID, C3_ID: EOS_ID}


class ScriptedRunner(ModelRunner):
    """Forces ``chain[last input token]`` (``first`` after any other token) at every step."""

    def __init__(self, base: ModelRunner, chain: Mapping[int, int], first: int = X_ID) -> None:
        super().__init__(base.model, num_blocks=base.num_blocks, block_size=base.block_size)
        self.chain, self.first = dict(chain), first

    def execute(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        rows = [c for c in chunks if c.need_logits]
        logits = torch.zeros((len(rows), self.config.vocab_size), dtype=torch.float32)
        for i, c in enumerate(rows):
            # NOTE: 60 nats above every other logit: probability 1 to float precision
            logits[i, self.chain.get(c.token_ids[-1], self.first)] = 60.0
        return logits


class PositionRunner(ModelRunner):
    """Forces ``script[position]`` (EOS past it) at every step: an output whose tokens repeat
    (a tool call's JSON), which a chain keyed on the last token cannot script."""

    def __init__(self, base: ModelRunner) -> None:
        super().__init__(base.model, num_blocks=base.num_blocks, block_size=base.block_size)
        self.script: dict[int, int] = {}

    def execute(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        rows = [c for c in chunks if c.need_logits]
        logits = torch.zeros((len(rows), self.config.vocab_size), dtype=torch.float32)
        for i, c in enumerate(rows):
            logits[i, self.script.get(c.start_pos + len(c.token_ids), EOS_ID)] = 60.0
        return logits


@dataclass
class ScriptedServer:
    engine: AsyncEngine
    live: LiveServer

    @property
    def url(self) -> str:
        return self.live.url


def scripted_server(chain: Mapping[int, int] = LEAD_BYTE_SCRIPT, *,
                    model_dir: Path = DEFAULT_MODEL_DIR, first: int = X_ID,
                    **settings: Any) -> Iterator[ScriptedServer]:
    """A live server over the scripted default model (use as a fixture body); ``model_dir``:
    the default model with another tokenizer or template (tests/reasoning_support.py)."""
    yield from served_runner(lambda base: ScriptedRunner(base, chain, first),
                             model_dir=model_dir, **settings)


def scripted_anthropic(served: ScriptedServer, messages: list[Any], tools: list[Any],
                       script: Sequence[int]) -> Any:
    """An ``anthropic`` client of ``served`` (a :class:`PositionRunner` engine) whose model
    writes ``script`` right after the prompt of ``messages`` with ``tools`` (its length taken
    from a probe request's usage, a prefix-cache hit included)."""
    import anthropic

    engine, runner = served.engine, served.engine.runner
    assert isinstance(runner, PositionRunner)
    client = anthropic.Anthropic(base_url=served.url, api_key="k", max_retries=0)
    probe = client.messages.create(model=engine.model_name, max_tokens=8, messages=messages,
                                   tools=tools)
    prompt = probe.usage.input_tokens + (probe.usage.cache_read_input_tokens or 0)
    runner.script = {prompt + i: t for i, t in enumerate(script)}
    return client


def served_runner(wrap: Callable[[ModelRunner], ModelRunner], *,
                  model_dir: Path = DEFAULT_MODEL_DIR, config: EngineConfig | None = None,
                  **settings: Any) -> Iterator[ScriptedServer]:
    """A live server over ``model_dir`` whose engine steps through ``wrap(its runner)`` (a
    scripted or held runner; use as a fixture body); ``engine.runner`` is the wrapped one."""
    from coda.server.app import create_app
    from coda.server.state import ServerSettings

    engine = AsyncEngine.from_model_dir(
        model_dir, config or EngineConfig(num_blocks=64, max_num_seqs=8))
    engine.runner = engine.core.runner = wrap(engine.runner)
    engine.start()
    app = create_app(engine, settings=ServerSettings(keepalive_s=0.5, **settings),
                     manage_engine=False)
    live = LiveServer(app).start()
    try:
        yield ScriptedServer(engine, live)
    finally:
        live.stop()
        engine.shutdown()
