"""The Ollama API's model endpoints (issue 23 item 2): ``GET /api/tags``, ``POST /api/show``,
``GET /api/ps`` and ``GET /api/version`` (``/api/embed``: :mod:`coda.server.embeddings`).

Every field comes from the served models' cards (``/v1/models``): ``digest`` is the weights'
SHA-256 (P1 identity), ``size`` the model's memory (weights + KV) where the server knows it
(several models), else 0. ``/api/ps`` lists the loaded models: with several models the ones
whose worker is up, with one model that model (loaded for the server's life, so no
``expires_at``). ``/api/version`` is Coda's version, not an Ollama version.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from coda.engine.protocol import Engine
from coda.models.identity import coda_version
from coda.server.common import state_of
from coda.server.http_errors import ApiError
from coda.server.ollama_schemas import OllamaShowRequest, model_name

router = APIRouter()
_WATCHERS: set[asyncio.Task[None]] = set()
_POLL_S = 0.1


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
_EPOCH = "1970-01-01T00:00:00Z"  # NOTE: Coda keeps no modification time of a model


def _cards(engine: Engine) -> list[dict[str, Any]]:
    cards = getattr(engine, "model_cards", None)  # NOTE: several models (ModelRouter)
    if cards is not None:
        return list(cards())
    identity = engine.identity
    return [{"id": engine.model_name, "max_model_len": engine.context_length,
             "coda": identity.to_dict() if identity is not None else {}}]


def _details(card: dict[str, Any]) -> dict[str, Any]:
    ident = card.get("coda") or {}
    quant = ident.get("quantization") or ident.get("quant_mode") or ident.get("dtype")
    return {"parent_model": "", "format": "gguf" if ident.get("quantization") else "coda",
            "family": "", "families": None, "parameter_size": "",
            "quantization_level": quant or ""}


def _entry(card: dict[str, Any]) -> dict[str, Any]:
    weights = (card.get("coda") or {}).get("weights_sha256") or ""
    size = int((card.get("coda_model") or {}).get("memory_bytes") or 0)
    return {"name": card["id"], "model": card["id"], "modified_at": _EPOCH, "size": size,
            "digest": weights, "details": _details(card)}


def _loaded(card: dict[str, Any]) -> bool:
    status = (card.get("coda_model") or {}).get("status")
    return status is None or status == "loaded"  # NOTE: one model: loaded for the server's life


@router.get("/api/tags")
async def tags(request: Request) -> Response:
    """Every served model."""
    return JSONResponse({"models": [_entry(c) for c in _cards(state_of(request).engine)]})


@router.get("/api/ps")
async def ps(request: Request) -> Response:
    """The models in memory now."""
    out = []
    for card in _cards(state_of(request).engine):
        if _loaded(card):
            e = _entry(card)
            out.append({**e, "size_vram": 0, "context_length": card.get("max_model_len")})
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
    return JSONResponse({
        "modelfile": "", "parameters": "", "license": "",
        "template": engine.chat.chat_template or "",
        "details": _details(card), "modified_at": _EPOCH,
        "model_info": {"general.name": engine.model_name,
                       "coda.context_length": engine.context_length,
                       "coda.identity": card.get("coda") or {}},
        # NOTE: tools through Coda's tool calling (coda.server.tools), embeddings through
        # coda.server.embeddings (mean-pooled hidden state), on every model
        "capabilities": ["completion", "tools", "embedding"]})

