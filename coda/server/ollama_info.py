"""The Ollama API's model endpoints (issue 23 item 2): ``GET /api/tags``, ``POST /api/show``,
``GET /api/ps`` and ``GET /api/version`` (``/api/embed``: :mod:`coda.server.embeddings`), and
the model's load and unload: the answer to an empty ``/api/chat`` / ``/api/generate`` (Ollama's
"load the model" call, :func:`load_answer`) and ``keep_alive: 0``.

Every field comes from the served models' cards (``/v1/models``): ``modified_at`` is the
checkpoint's last change (the card's ``created``: its file's time), ``digest`` is the weights'
SHA-256 (P1 identity), ``size`` the model's memory (weights + KV) where the server knows it
(several models), else 0; ``details`` (family, parameter size, stored type) come from each
model's checkpoint header, read when the server starts, so a model of several that has not
loaded yet is described as it will be once loaded. ``/api/ps`` lists the loaded models: with
several models the ones whose worker is up, with one model that model. A loaded model
stays until the server stops (or the memory budget's LRU, or ``keep_alive: 0``, unloads it):
no timer expires it, so ``expires_at`` is Ollama's "forever" (now plus Go's longest duration,
the value Ollama gives a model kept with a negative ``keep_alive``); ``size_vram`` is 0 (Coda
runs on the CPU). ``/api/version`` is Coda's version, not an Ollama version.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from coda.engine.protocol import Engine, ModelInfo
from coda.models.gguf_file import FILE_TYPES
from coda.models.identity import coda_version
from coda.server.common import now, state_of
from coda.server.http_errors import ApiError
from coda.server.ndjson import JSONLine, NDJSONRenderer
from coda.server.ollama_schemas import (
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaShowRequest,
    model_name,
)
from coda.server.ollama_wire import created_at, keep_alive_zero
from coda.server.operational_routes import model_card
from coda.server.state import ServerState

router = APIRouter()
_WATCHERS: set[asyncio.Task[None]] = set()
_POLL_S = 0.1


def load_answer(st: ServerState, body: OllamaChatRequest | OllamaGenerateRequest,
                chat: bool) -> Response:
    """Ollama's answer to an empty ``/api/chat`` / ``/api/generate`` request, its "load the
    model" call (nothing is generated): ``load``, or with
    ``keep_alive: 0`` and several models ``unload`` once the model is out of memory (a busy
    model is unloaded when its requests end)."""
    reason = "load"
    if keep_alive_zero(body.keep_alive):
        result = unload_now(st.engine)
        if result == "busy":
            unload_when_idle(st.engine)
        if result is not None and result != "pinned":
            reason = "unload"
    obj: dict[str, Any] = {"model": body.model, "created_at": created_at(now()),
                           **({"message": {"role": "assistant", "content": ""}} if chat
                              else {"response": ""}),
                           "done": True, "done_reason": reason}
    if body.stream:
        return Response(JSONLine(obj).encode(), media_type=NDJSONRenderer.media_type)
    return JSONResponse(obj)


def unload_now(engine: Engine) -> str | None:
    """``keep_alive: 0`` on an empty request: unload the selected model now (see
    :meth:`~coda.server.model_loads.ModelLoads.unload_idle`); None with one model served
    (``keep_alive`` then has no effect: the model is loaded for the server's life)."""
    loads = getattr(engine, "loads", None)  # NOTE: several models (ModelRouter)
    if loads is None:
        return None
    result: str = loads.unload_idle(engine.model_name)
    return result


def unload_when_idle(engine: Engine) -> None:
    """``keep_alive: 0`` on a generation: unload the selected model once nothing of it is in
    flight (this request and any other); nothing with one model served."""
    loads = getattr(engine, "loads", None)
    if loads is None:
        return
    name = engine.model_name

    async def watch() -> None:
        while await asyncio.to_thread(loads.unload_idle, name) == "busy":
            await asyncio.sleep(_POLL_S)

    task = asyncio.get_running_loop().create_task(watch())
    _WATCHERS.add(task)
    task.add_done_callback(_WATCHERS.discard)
# NOTE: Ollama's "forever" (keep_alive < 0): now plus Go's longest duration, 2^63-1 ns (about
# 292 years; its CLI shows any expiry past 20 years as "Forever")
_FOREVER_S = (2**63 - 1) / 1e9


def _cards(engine: Engine) -> list[dict[str, Any]]:
    cards = getattr(engine, "model_cards", None)  # NOTE: several models (ModelRouter)
    if cards is not None:
        return list(cards())
    return [model_card(engine)]  # NOTE: one model: its /v1/models card


def parameter_size(count: int) -> str:
    """A parameter count as Ollama writes ``details.parameter_size``: billions with one
    decimal, millions with two (no decimals when whole), thousands rounded ("134.52M",
    "1.2B", "7B"); "" when unknown."""
    if count <= 0:
        return ""
    for unit, scale, places in (("B", 10**9, 1), ("M", 10**6, 2), ("K", 10**3, 0)):
        if count >= scale:
            value = count / scale
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.{places}f}{unit}"
    return str(count)


def file_type(quantization: str) -> int | None:
    """llama.cpp's ``general.file_type`` of a stored tensor type (None when it has none)."""
    code = _FILE_TYPE_CODES.get(quantization)
    return code if code is not None else _FILE_TYPE_CODES.get(_DENSE.get(quantization, ""))


_FILE_TYPE_CODES = {name: code for code, name in FILE_TYPES.items()}
_DENSE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def _details(card: dict[str, Any], info: ModelInfo | None = None) -> dict[str, Any]:
    """Ollama's ``details``: family (the architecture), parameter size and quantization
    level (the stored tensor type, ``Q4_1``/``F32`` as Ollama names them) where known."""
    ident = card.get("coda") or {}
    quant = (info.quantization if info is not None and info.quantization else
             ident.get("quantization") or ident.get("quant_mode") or ident.get("dtype") or "")
    arch = info.architecture if info is not None else ""
    # NOTE: a folder's stored type is its torch dtype ("float32"); a GGUF's a type name ("Q4_1")
    gguf = bool(ident.get("quantization")) or bool(quant) and quant not in _DENSE
    return {"parent_model": "", "format": "gguf" if gguf else "coda",
            "family": arch, "families": [arch] if arch else None,
            "parameter_size": parameter_size(info.parameters if info is not None else 0),
            "quantization_level": _DENSE.get(quant, quant)}


def _model_info(engine: Engine, card: dict[str, Any], info: ModelInfo | None) -> dict[str, Any]:
    """Ollama's ``model_info`` (GGUF metadata keys) from the loaded model, plus Coda's own
    keys. ``<arch>.context_length`` is the served context (what a client may fill)."""
    out: dict[str, Any] = {"general.name": engine.model_name}
    if info is not None and info.architecture:
        arch = info.architecture
        out["general.architecture"] = arch
        out[f"{arch}.context_length"] = engine.context_length
        if info.parameters:
            out["general.parameter_count"] = info.parameters
        code = file_type(info.quantization)
        if code is not None:
            out["general.file_type"] = code
    out.update({"coda.context_length": engine.context_length,
                "coda.identity": card.get("coda") or {}})
    return out


def _infos(engine: Engine) -> dict[str, ModelInfo]:
    """Each served model's :class:`ModelInfo` by name: with several models each slot's (read
    from its checkpoint's header when described, so a model not loaded yet has its family,
    size and stored type too), else the one engine's."""
    slots = getattr(engine, "slots", None)  # NOTE: several models (ModelRouter)
    if slots is not None:
        return {s.name: s.info for s in slots if s.info is not None}
    info = engine.model_info()
    return {info.name: info}


def _modified(card: dict[str, Any]) -> str:
    """The checkpoint's last change (the card's ``created``), as Ollama's ``modified_at``."""
    return created_at(int(card.get("created") or 0))


def _entry(card: dict[str, Any], infos: dict[str, ModelInfo]) -> dict[str, Any]:
    weights = (card.get("coda") or {}).get("weights_sha256") or ""
    size = int((card.get("coda_model") or {}).get("memory_bytes") or 0)
    return {"name": card["id"], "model": card["id"], "modified_at": _modified(card), "size": size,
            "digest": weights, "details": _details(card, infos.get(card["id"]))}


def _loaded(card: dict[str, Any]) -> bool:
    status = (card.get("coda_model") or {}).get("status")
    return status is None or status == "loaded"  # NOTE: one model: loaded for the server's life


@router.get("/api/tags")
async def tags(request: Request) -> Response:
    """Every served model."""
    engine = state_of(request).engine
    infos = _infos(engine)
    return JSONResponse({"models": [_entry(c, infos) for c in _cards(engine)]})


@router.get("/api/ps")
async def ps(request: Request) -> Response:
    """The models in memory now."""
    out = []
    engine = state_of(request).engine
    infos = _infos(engine)
    never = created_at(now() + _FOREVER_S)
    for card in _cards(engine):
        if _loaded(card):
            e = _entry(card, infos)
            out.append({**e, "expires_at": never, "size_vram": 0,
                        "context_length": card.get("max_model_len")})
    return JSONResponse({"models": out})


@router.get("/api/version")
async def version() -> Response:
    return JSONResponse({"version": coda_version()})


@router.post("/api/show")
async def show(body: OllamaShowRequest, request: Request) -> Response:
    """One model: its chat template, details, context length and capabilities."""
    name = body.model or body.name
    if not name:
        raise ApiError(400, "model: required", param="model")
    st = state_of(request)
    st.check_model(model_name(name))
    engine = st.engine
    card = next((c for c in _cards(engine) if c["id"] == engine.model_name), None)
    card = card or {"id": engine.model_name, "max_model_len": engine.context_length}
    info = engine.model_info()
    return JSONResponse({
        "modelfile": "", "parameters": "", "license": "",
        "template": engine.chat.chat_template or "",
        "details": _details(card, info), "modified_at": _modified(card),
        "model_info": _model_info(engine, card, info),
        "capabilities": capabilities(st)})


def capabilities(st: ServerState) -> list[str]:
    """What Ollama's ``/api/show`` says of the routed model, as Ollama decides it (P1):
    ``completion`` (a generative model: ``embedding`` is an embedding model's alone, one
    with a pooling type, which Coda serves none of), ``tools`` (Coda's tool calling,
    :mod:`coda.server.tools`, serves every model), ``thinking`` when the model has the
    reasoning markers ``think`` needs. Clients pick their embedding models by
    ``embedding``; ``/api/embed`` still serves every model, as Ollama's does."""
    return ["completion", "tools"] + (["thinking"] if st.reasoning_markers() else [])

