"""The per-token reference of prompt scoring (SPEC O1, T4): what the engine reports when it
*decodes* a token after the tokens before it. A prompt token's scored record (legacy
completions ``echo`` + ``logprobs``, coda.server.echo) must be exactly this record in a
batch-invariant mode; it is also the method the one-prefill scoring replaced (one greedy
request per position, ``logit_bias`` forcing the token)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from coda.engine.types import GenerationRequest
from coda.reader import replay
from coda.sampling import MAX_ABS_BIAS, SamplingParams
from coda.stream import EventType, TokenInfo


def streamed_tokens(handle: Any) -> list[TokenInfo]:
    """Every token record of an engine request, in order (its deltas, then its trailing)."""
    terminal = handle.wait(300)
    return ([t for e in replay(handle.stream) if e.type is EventType.DELTA for t in e.tokens]
            + list(terminal.trailing_tokens))


def decoded_record(engine: Any, prefix: Sequence[int], token: int, k: int) -> TokenInfo:
    """The engine's own decode record of ``token`` after ``prefix`` (the per-token method)."""
    got = streamed_tokens(engine.submit(GenerationRequest(
        tuple(prefix), SamplingParams(temperature=0.0, logit_bias=((token, MAX_ABS_BIAS),),
                                      logprobs=k), max_tokens=1, skip_special_tokens=False,
        speculative=False)))
    assert len(got) == 1 and got[0].token_id == token
    return got[0]


def legacy_entry(rec: TokenInfo) -> list[float]:
    """The values of a legacy ``top_logprobs`` entry holding ``rec``: its ``k`` best, then the
    token itself where it is not among them (as OpenAI and vLLM)."""
    own = [] if rec.token_id in {t for t, _ in rec.top_logprobs} else [rec.logprob]
    return [v for _, v in rec.top_logprobs] + own
