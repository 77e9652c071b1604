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

How: ONE engine request per prompt, ``max_tokens`` 0 with ``prompt_logprobs`` ``k``: the engine
prefills the prompt chunk by chunk, takes every row's logits and reduces each at once to its
token's record (:meth:`coda.engine.sampler.Sampler.score`, the same operations as a decode's
record, so in a batch-invariant mode the same bits, T4); it computes every position (no
prefix-cache reuse for it) and ends ``max_output_tokens`` with no token. Its terminal carries
the records (:attr:`coda.finish.Terminal.prompt_logprobs`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from coda.engine.protocol import Engine
from coda.engine.types import GenerationRequest
from coda.errors import InvalidRequestError, ModelError
from coda.finish import FinishReason
from coda.sampling import SamplingParams
from coda.server import logprobs as lp
from coda.server.schemas import CompletionRequest
from coda.server.state import ServerState
from coda.stream import TokenInfo


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
    if len(ids) == 1:
        return [_first(engine, ids[0])]
    handle = engine.submit(GenerationRequest(
        prompt_token_ids=tuple(ids), sampling=SamplingParams(temperature=0.0), max_tokens=0,
        skip_special_tokens=False, request_id=request_id, speculative=False,
        prompt_logprobs=k))
    try:
        terminal = await handle.result()
    except BaseException:
        handle.cancel()  # NOTE: a cancelled parse (the client went away) leaves nothing running
        raise
    scored = terminal.prompt_logprobs
    if terminal.finish_reason is not FinishReason.MAX_OUTPUT_TOKENS or len(scored) != len(ids) - 1:
        raise ModelError(f"prompt logprobs: the scoring request ended "
                         f"{terminal.finish_reason.value} after {len(scored)} of "
                         f"{len(ids) - 1} tokens"
                         + (f": {terminal.error_message}" if terminal.error_message else ""))
    return [_first(engine, ids[0]), *scored]


def _as_written(tokens: Sequence[TokenInfo], text: str) -> list[TokenInfo]:
    """A text prompt's tokens, each special one marked as text where ``text`` (the prompt as
    sent) writes it at that point (``"<|endoftext|>Hello"``), else as special (a BOS the
    tokenizer added): with the skip rule, exactly the tokens written move ``text_offset``."""
    out, at = [], 0
    for t in tokens:
        piece = t.piece.decode("utf-8", errors="replace")
        if t.special:
            t = replace(t, special=not text.startswith(piece, at))
        if not t.special:
            at += len(piece)
        out.append(t)
    return out


def echo_legacy(tokens: Sequence[TokenInfo], text: str, *,
                skip_special: bool, written: bool = False) -> dict[str, Any]:
    """The legacy ``logprobs`` of an echoed prompt whose text is ``text``; the first token's
    ``top_logprobs`` is ``null``, as its logprob. ``written``: ``text`` is the prompt as sent
    (a text prompt), whose special tokens are text where it writes them (:func:`_as_written`);
    else it is the ids' decode, which shows them unless ``skip_special``."""
    if written:
        tokens, skip_special = _as_written(tokens, text), True
    out = lp.legacy_logprobs(tokens, 0, len(text), skip_special=skip_special)
    if out["top_logprobs"]:
        out["top_logprobs"][0] = None
    return out


def _items(body: CompletionRequest) -> list[object]:
    """Each prompt as sent: a text, or a list of ids."""
    p = body.prompt
    # NOTE: one token-id prompt is a flat list of ints (cf. _prompts)
    return [p] if isinstance(p, str) or all(isinstance(x, int) for x in p) else list(p)


def _texts(st: ServerState, body: CompletionRequest,
                prompts: Sequence[Sequence[int]]) -> tuple[str, ...]:
    """Each prompt's echoed text (module docstring)."""
    if not body.echo:
        return ()
    items = _items(body)
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
    # NOTE: the scoring requests are engine requests like any: admitted by the same rule
    # (a full queue is a 429 before the prompt is scored, not after)
    st.admit(len(prompts))
    scored = await asyncio.gather(*(
        prompt_tokens(st.engine, ids, k, f"{call_id}-echo{j}")
        for j, ids in enumerate(prompts)))
    return tuple(echo_legacy(toks, text, skip_special=body.skip_special_tokens,
                             written=isinstance(item, str))
                 for toks, text, item in zip(scored, texts, _items(body), strict=True))


async def echo_parts(st: ServerState, body: CompletionRequest, prompts: list[list[int]],
                     call_id: str) -> tuple[tuple[str, ...], tuple[dict[str, Any], ...]]:
    """The render spec's ``echo`` and ``echo_logprobs`` of a completions call (both empty
    without echo; the logprobs empty without ``logprobs``)."""
    texts = await asyncio.to_thread(_texts, st, body, prompts)  # NOTE: decoding is CPU-bound
    return texts, await _logprobs(st, body, prompts, texts, call_id)
