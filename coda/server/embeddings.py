"""Embeddings (issue 23 item 2): ``POST /api/embed`` and the older ``POST /api/embeddings``
(Ollama), ``POST /v1/embeddings`` (OpenAI).

What an embedding is here: the mean over the input's tokens of the model's last hidden state
(after the final norm, before the LM head), run per input on the engine thread in chunks of
the prefill chunk size between decode steps, over a scratch KV cache (the engine's cache and
prefix entries are untouched; coda.engine.embed_job); a client that disconnects cancels it at
its next chunk (the route answers 499). Every served model can embed, but a generative model's
pooled state is a weak sentence embedding: use it for what it is.

Per protocol: ``/api/embed`` and ``/v1/embeddings`` return vectors of unit L2 norm (as Ollama
and OpenAI do), ``/api/embeddings`` the raw mean; ``dimensions`` keeps the first *d* values and
normalises again (Matryoshka-style truncation). The input is tokenized with the model's
special tokens (its BOS), as a completion prompt is. Ollama's ``truncate`` (default on) cuts an
input to the context; off, or on the OpenAI API, a longer input is a 400. An empty ``input``
on ``/api/embed`` loads the model and returns no embeddings (Ollama's behaviour).

Admission (docs/api.md, "Admission"; SPEC L5): one call is one engine request for
:meth:`ServerState.admit`, checked before anything is tokenized or embedded, as a chat's
generations are: 503 while the server shuts down, 429 + ``Retry-After`` on a full waiting
queue. An input past the context is the
400 ``context_length_exceeded`` a chat prompt gets (:meth:`ServerState.encode`'s byte bound,
then :func:`coda.engine.plan.check_embedding_input`).
"""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import time
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, field_validator
from starlette.responses import JSONResponse, Response

from coda.errors import InvalidRequestError
from coda.server.common import ClientGone, disconnected, state_of
from coda.server.http_errors import ApiError
from coda.server.ollama_info import unload_when_idle
from coda.server.ollama_schemas import OllamaEmbedRequest, model_name
from coda.server.ollama_wire import keep_alive_zero
from coda.server.schemas import STRICT
from coda.server.state import ServerState

router = APIRouter()
MAX_INPUTS = 2048  # NOTE: OpenAI's limit on inputs per request


class OpenAIEmbeddingRequest(BaseModel):
    """``POST /v1/embeddings``: text, texts, token ids or lists of token ids."""

    model_config = STRICT
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _one_kind(cls, value: Any) -> Any:
        """A clear 400 for an input of no accepted kind, or a list mixing them (pydantic's
        union said "Input should be a valid string" of a list of ints and strings)."""
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError(f"must be {_KINDS} (got {type(value).__name__})")
        kinds = {_kind(x) for x in value}
        if len(kinds) > 1 or None in kinds:
            raise ValueError(f"must be {_KINDS}, one kind per request (got a list of "
                             f"{' and '.join(sorted(k or 'other values' for k in kinds))})")
        return value


_KINDS = "a string, a list of strings, a list of token ids or a list of token-id lists"


def _kind(item: Any) -> str | None:
    if isinstance(item, str):
        return "strings"
    if isinstance(item, int) and not isinstance(item, bool):
        return "token ids"
    if isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                      for t in item):
        return "token-id lists"
    return None


def normalised(vector: list[float], dimensions: int | None) -> list[float]:
    """The first ``dimensions`` values (all if None) scaled to unit L2 norm (a zero vector
    stays zero). ``dimensions`` above the vector's size is a 400."""
    if dimensions is not None:
        if dimensions > len(vector):
            raise InvalidRequestError(f"dimensions: {dimensions} exceeds this model's "
                                      f"embedding size {len(vector)}", field="dimensions")
        vector = vector[:dimensions]
    norm = math.sqrt(math.fsum(x * x for x in vector))
    return [x / norm for x in vector] if norm > 0 else list(vector)


def admit(st: ServerState) -> None:
    """Admission for one embedding call (see the module doc): one engine request, whatever
    its number of inputs, since they run one at a time and never more than one waits (so
    OpenAI's 2048-input batches pass with any ``--max-waiting``).
    NOTE: of admission's checks, KV fit does not apply: an embedding holds no KV block and no
    batch slot (it runs between two steps over a scratch cache sized for its input), so once
    admitted it is never preempted or starved of blocks. Its inputs then run one at a time,
    each queued once the one before has run (they interleave with decode steps); a queued
    one counts as waiting whatever the batch slots free
    (:meth:`coda.engine.async_engine.AsyncEngine.num_queued`; with several models or replicas,
    the front's count holds generation requests only)."""
    st.admit(1, "embedding call", takes_slot=False)


async def embed_all(st: ServerState, request: Request,
                    inputs: list[list[int]]) -> list[list[float]]:
    """One raw embedding per input, in order (a refusal is a CodaError: the server's 4xx);
    the route has admitted them (:func:`admit`). A client that disconnects first cancels the
    embedding running (it stops at its next chunk, coda.engine.embed_job) and the inputs
    after it, and :class:`ClientGone` is raised (the route answers 499)."""
    work = asyncio.ensure_future(_embed_each(st, inputs))
    watch = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():  # NOTE: the client left, or this route itself was cancelled
            work.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
    if work.cancelled():
        raise ClientGone("embedding")
    return work.result()


async def _embed_each(st: ServerState, inputs: list[list[int]]) -> list[list[float]]:
    return [await st.engine.embed(ids) for ids in inputs]


def _encode_texts(st: ServerState, texts: list[str], truncate: bool) -> list[list[int]]:
    out = []
    for text in texts:
        if not text:
            raise InvalidRequestError("input: an input must not be empty", field="input")
        out.append(st.encode(text, add_special_tokens=True, field="input", truncate=truncate))
    return out


async def _encoded(st: ServerState, texts: list[str], truncate: bool) -> list[list[int]]:
    return await asyncio.to_thread(_encode_texts, st, texts, truncate)  # NOTE: CPU-bound


@router.post("/api/embed")
async def ollama_embed(body: OllamaEmbedRequest, request: Request) -> Response:
    """Ollama's ``/api/embed``: unit-norm vectors, one per input."""
    st = state_of(request)
    st.check_model(model_name(body.model))
    if body.prompt is not None:
        raise ApiError(400, "prompt: /api/embed takes `input` (`prompt` is /api/embeddings')",
                       param="prompt")
    start = time.monotonic_ns()
    texts = [body.input] if isinstance(body.input, str) else list(body.input)
    texts = [] if texts == [""] else texts
    if len(texts) > MAX_INPUTS:
        raise ApiError(400, f"input: at most {MAX_INPUTS} inputs", param="input")
    admit(st)
    inputs = await _encoded(st, texts, body.truncate)
    try:
        vectors = [normalised(v, body.dimensions) for v in await embed_all(st, request, inputs)]
    except ClientGone:
        return Response(status_code=499)
    if keep_alive_zero(body.keep_alive):
        unload_when_idle(st.engine)
    return JSONResponse({
        "model": body.model, "embeddings": vectors,
        "total_duration": time.monotonic_ns() - start, "load_duration": 0,
        "prompt_eval_count": sum(len(ids) for ids in inputs)})


@router.post("/api/embeddings")
async def ollama_embeddings_legacy(body: OllamaEmbedRequest, request: Request) -> Response:
    """Ollama's older endpoint: one ``prompt``, the raw (not normalised) vector."""
    st = state_of(request)
    st.check_model(model_name(body.model))
    if body.input:
        raise ApiError(400, "input: /api/embeddings takes `prompt` (`input` is /api/embed's)",
                       param="input")
    if not body.prompt:
        return JSONResponse({"embedding": []})
    admit(st)
    inputs = await _encoded(st, [body.prompt], body.truncate)
    try:
        (vector,) = await embed_all(st, request, inputs)
    except ClientGone:
        return Response(status_code=499)
    if body.dimensions is not None:
        vector = normalised(vector, body.dimensions)
    if keep_alive_zero(body.keep_alive):
        unload_when_idle(st.engine)
    return JSONResponse({"embedding": vector})


@router.post("/v1/embeddings")
async def openai_embeddings(body: OpenAIEmbeddingRequest, request: Request) -> Response:
    """OpenAI's embeddings: unit-norm vectors, as floats or base64 of little-endian float32
    (what the official client asks for by default)."""
    st = state_of(request)
    st.check_model(body.model)
    raw = body.input
    if isinstance(raw, str):
        raw = [raw]
    # NOTE: OpenAI's own answer to both is a vague "'$.input' is invalid" with no code; these
    # are the words and codes OpenAI gives an empty or too long array on its other endpoints
    if not raw:
        raise ApiError(400, "input: empty array. Expected an array with minimum length 1, but "
                       "got an empty array instead.", param="input", code="empty_array")
    # NOTE: one list of token ids is ONE input, its length bounded by the context (OpenAI's
    # cookbook embeds 8191-token lists), not 2048 inputs
    one = all(isinstance(x, int) for x in raw)
    if not one and len(raw) > MAX_INPUTS:
        raise ApiError(400, f"input: array too long. Expected an array with maximum length "
                       f"{MAX_INPUTS}, but got an array with length {len(raw)} instead.",
                       param="input", code="array_above_max_length")
    admit(st)
    # NOTE: the filters narrow the union's items for mypy; ``all`` has checked every one
    if one:
        inputs: list[list[int]] = [[x for x in raw if isinstance(x, int)]]
    elif all(isinstance(x, list) for x in raw):
        inputs = [list(x) for x in raw if isinstance(x, list)]
    else:
        inputs = await _encoded(st, [str(x) for x in raw], truncate=False)
    try:
        vectors = [normalised(v, body.dimensions) for v in await embed_all(st, request, inputs)]
    except ClientGone:
        return Response(status_code=499)
    data = [{"object": "embedding", "index": i,
             "embedding": (base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()
                           if body.encoding_format == "base64" else v)}
            for i, v in enumerate(vectors)]
    used = sum(len(ids) for ids in inputs)
    return JSONResponse({"object": "list", "data": data, "model": body.model,
                         "usage": {"prompt_tokens": used, "total_tokens": used}})
