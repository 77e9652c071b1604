"""Legacy completions ``echo`` (docs/api.md, "Echo"): each prompt's text, and with
``logprobs`` its tokens' logprobs (SPEC O1, L6).

The text: a text prompt exactly as sent; a token-id prompt decoded (special tokens shown unless
``skip_special_tokens``, like the output). It and the prompt's logprobs travel in the render
spec (:class:`coda.server.render_spec.OpenAIRender`), so a resume or replay renders the same.

What a prompt token's logprob is here: exactly what the same token would get if the model had
*decoded* it after the tokens before it — the log_softmax of the raw logits at that position
(:class:`coda.engine.sampler.TokenDecision`), with its top ``k`` alternatives, like every
completion token's. The first prompt token has no context: its logprob and top logprobs are
``null`` (as OpenAI and vLLM report them).

How: for each prompt position ``i >= 1`` one engine request decodes a single token after
``prompt[:i]``, greedy, with ``logit_bias`` +100 on ``prompt[i]`` so that token is the one
selected. A bias never moves the reported values (they are under the raw logits), so each
entry *is* the engine's own decode record of that token. The requests share the prompt's
prefix-cache blocks, so each computes at most one block of new positions; the cost is one
short request per prompt token, paid only by requests that ask for echo with logprobs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from coda.engine.protocol import Engine, EngineHandle
from coda.engine.types import GenerationRequest
from coda.errors import InvalidRequestError, ModelError
from coda.reader import replay
from coda.sampling import MAX_ABS_BIAS, SamplingParams
from coda.server import logprobs as lp
from coda.server.schemas import CompletionRequest
from coda.server.state import ServerState
from coda.stream import EventType, TokenInfo


def _forced(handle: EngineHandle, target: int) -> TokenInfo:
    """The one token ``handle`` selected (a delta's, or a trailing token's: EOS, held bytes)."""
    terminal = handle.stream.terminal
    assert terminal is not None
    tokens = [t for e in replay(handle.stream) if e.type is EventType.DELTA for t in e.tokens]
    tokens += terminal.trailing_tokens
    if len(tokens) != 1 or tokens[0].token_id != target:
        # NOTE: a raw logit gap above MAX_ABS_BIAS, or the request ended early
        raise ModelError(f"prompt logprobs: could not score token {target} "
                         f"({terminal.finish_reason})")
    return tokens[0]


def _first(engine: Engine, token_id: int) -> TokenInfo:
    """The first prompt token: no context, so no logprob; its text and special flag only."""
    tok = engine.tokenizer
    text = tok.decode([token_id], skip_special_tokens=False)
    special = bool(text) and not tok.decode([token_id], skip_special_tokens=True)
    return TokenInfo(token_id, None, (), text.encode("utf-8"), (), special)


async def prompt_tokens(engine: Engine, ids: Sequence[int], k: int,
                        request_id: str) -> list[TokenInfo]:
    """The prompt's tokens with their logprobs and ``k`` alternatives (module docstring)."""
    if not ids:
        return []

    def submit(i: int) -> EngineHandle:
        sampling = SamplingParams(temperature=0.0, logit_bias=((ids[i], MAX_ABS_BIAS),),
                                  logprobs=k)
        try:
            return engine.submit(GenerationRequest(
                prompt_token_ids=tuple(ids[:i]), sampling=sampling, max_tokens=1,
                skip_special_tokens=False, request_id=f"{request_id}-{i}", speculative=False))
        except InvalidRequestError as exc:
            if exc.field != "logit_bias":
                raise
            # NOTE: the bias names the prompt's own token: the client's error is the prompt
            raise InvalidRequestError(f"prompt: token {ids[i]} at position {i}: {exc.message}",
                                      field="prompt") from None

    last: list[EngineHandle] = []
    handles: list[EngineHandle] = []  # NOTE: positions 1 .. n-2, in order
    try:
        if len(ids) > 1:
            # NOTE: the longest prefix first, alone: its full blocks enter the prefix cache,
            # so each later request computes under one block, not its whole prefix (O(n^2))
            last.append(submit(len(ids) - 1))
            await last[0].result()
        for i in range(1, len(ids) - 1):
            handles.append(submit(i))
        await asyncio.gather(*(h.result() for h in handles))
    finally:
        for h in (*handles, *last):  # NOTE: a failure or a cancelled parse leaves none running
            h.cancel()
    handles += last
    return [_first(engine, ids[0]),
            *(_forced(h, t) for h, t in zip(handles, ids[1:], strict=True))]


def echo_legacy(tokens: Sequence[TokenInfo], text: str, *,
                skip_special: bool) -> dict[str, Any]:
    """The legacy ``logprobs`` of an echoed prompt whose text is ``text``; the first token's
    ``top_logprobs`` is ``null``, as its logprob."""
    out = lp.legacy_logprobs(tokens, 0, len(text), skip_special=skip_special)
    if out["top_logprobs"]:
        out["top_logprobs"][0] = None
    return out


def _texts(st: ServerState, body: CompletionRequest,
                prompts: Sequence[Sequence[int]]) -> tuple[str, ...]:
    """Each prompt's echoed text (module docstring)."""
    if not body.echo:
        return ()
    p = body.prompt
    # NOTE: one token-id prompt is a flat list of ints (cf. _prompts)
    items: list[object] = ([p] if isinstance(p, str) or all(isinstance(x, int) for x in p)
                           else list(p))
    tok = st.engine.tokenizer
    vocab = tok.get_vocab_size(with_added_tokens=True)
    for x, ids in zip(items, prompts, strict=True):
        # NOTE: decoded here, before the engine's own prompt check: an id the tokenizer cannot
        # hold (negative, past its table) is the client's error, said as the engine says it
        if not isinstance(x, str) and any(not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})",
                                      field="prompt")
    return tuple(x if isinstance(x, str)
                 else tok.decode(list(ids), skip_special_tokens=body.skip_special_tokens)
                 for x, ids in zip(items, prompts, strict=True))


async def _logprobs(st: ServerState, body: CompletionRequest, prompts: list[list[int]],
                         texts: tuple[str, ...], call_id: str
                         ) -> tuple[dict[str, Any], ...]:
    """Echo with logprobs: each prompt's own legacy logprobs."""
    if not body.echo or body.logprobs is None:
        return ()
    k = body.logprobs
    scored = await asyncio.gather(*(
        prompt_tokens(st.engine, ids, k, f"{call_id}-echo{j}")
        for j, ids in enumerate(prompts)))
    return tuple(echo_legacy(toks, text, skip_special=body.skip_special_tokens)
                 for toks, text in zip(scored, texts, strict=True))


async def echo_parts(st: ServerState, body: CompletionRequest, prompts: list[list[int]],
                     call_id: str) -> tuple[tuple[str, ...], tuple[dict[str, Any], ...]]:
    """The render spec's ``echo`` and ``echo_logprobs`` of a completions call (both empty
    without echo; the logprobs empty without ``logprobs``)."""
    texts = await asyncio.to_thread(_texts, st, body, prompts)  # NOTE: decoding is CPU-bound
    return texts, await _logprobs(st, body, prompts, texts, call_id)
