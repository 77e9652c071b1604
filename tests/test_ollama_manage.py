"""The Ollama API's model-management endpoints through the official ``ollama`` client
(issue 23 item 2; SPEC P1): ``pull`` of a served model succeeds with nothing to download,
of any other model is a 404; ``delete``, ``copy``, ``create`` and ``push`` are a 403 naming
why (a 404 for a model that does not exist, as Ollama); bad bodies are a 400 in Ollama's
shape (:mod:`coda.server.ollama_manage`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, cast

import httpx
import ollama
import pytest

MODEL = "tiny-chat"


@pytest.fixture
def client(server_live: Any) -> ollama.Client:
    return ollama.Client(host=server_live.url)


@pytest.mark.parametrize("name", [MODEL, MODEL + ":latest"])
def test_p1_pull_of_a_served_model_succeeds_streamed_and_not(client: ollama.Client,
                                                            name: str) -> None:
    """P1: a served model (``:latest`` too) pulls with nothing to do: ``success`` whole, or
    streamed status lines ending with ``success`` and no byte progress."""
    assert client.pull(name, stream=False).status == "success"
    parts = list(client.pull(name, stream=True))
    assert [p.status for p in parts] == ["pulling manifest", "success"]
    assert all(p.total is None and p.completed is None for p in parts)


def test_p1_pull_streams_ndjson_by_default(server_live: Any) -> None:
    """P1: as Ollama, a pull without ``stream`` (or with ``null``) streams NDJSON; an old
    ``name`` works."""
    for body in ({"name": MODEL}, {"model": MODEL, "stream": None}):
        r = httpx.post(server_live.url + "/api/pull", json=body, timeout=30)
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.text.splitlines() if line]
        assert lines == [{"status": "pulling manifest"}, {"status": "success"}]


@pytest.mark.parametrize("stream", [False, True])
def test_p1_pull_of_an_unknown_model_is_a_404_naming_why(client: ollama.Client,
                                                        stream: bool) -> None:
    """P1: a model Coda does not serve is a 404 ``{"error"}``, streamed too: nothing is
    downloaded, and the message says so and names what is served."""
    with pytest.raises(ollama.ResponseError) as e:
        out = client.pull("llama3.2", stream=stream)  # type: ignore[call-overload]
        if stream:
            list(out)
    assert e.value.status_code == 404
    assert "llama3.2" in e.value.error and "nothing is downloaded" in e.value.error
    assert MODEL in e.value.error


@pytest.mark.parametrize("call", ["delete", "copy", "push", "create"])
def test_p1_management_of_a_served_model_is_a_403(client: ollama.Client, call: str) -> None:
    """P1: Coda cannot delete, copy, push or create models (they come from ``--model``):
    a 403 naming why, never a bare 404 nor a 5xx."""
    calls: dict[str, Callable[[], object]] = {
        "delete": lambda: client.delete(MODEL),
        "copy": lambda: client.copy(MODEL, "other"),
        "push": lambda: client.push(MODEL, stream=False),
        "create": lambda: client.create("mine", from_=MODEL, stream=False)}
    with pytest.raises(ollama.ResponseError) as e:
        calls[call]()
    assert e.value.status_code == 403
    assert "not supported" in e.value.error and "--model" in e.value.error


@pytest.mark.parametrize("call", ["delete", "copy", "push"])
def test_p1_management_of_an_unknown_model_is_a_404(client: ollama.Client, call: str) -> None:
    """P1: as Ollama, deleting, copying or pushing a model that does not exist is a 404."""
    calls: dict[str, Callable[[], object]] = {
        "delete": lambda: client.delete("nope"),
        "copy": lambda: client.copy("nope", "other"),
        "push": lambda: list(client.push("nope", stream=True))}
    with pytest.raises(ollama.ResponseError) as e:
        calls[call]()
    assert e.value.status_code == 404 and "nope" in e.value.error


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/api/pull", {}),
    ("POST", "/api/pull", {"model": 3}),
    ("POST", "/api/pull", {"model": MODEL, "stream": "yes"}),
    ("POST", "/api/pull", {"model": MODEL, "insecure": "no"}),
    ("DELETE", "/api/delete", {}),
    ("POST", "/api/copy", {"source": MODEL}),
    ("POST", "/api/copy", {"destination": "x"}),
    ("POST", "/api/create", {}),
    ("POST", "/api/push", {"name": ["x"]}),
])
def test_p1_bad_bodies_are_a_400_in_ollamas_shape(server_live: Any, method: str, path: str,
                                                  body: dict[str, Any]) -> None:
    """P1: a missing model (or copy's source/destination) or a field of the wrong type is a
    400 ``{"error": "..."}``."""
    r = httpx.request(method, server_live.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert list(r.json()) == ["error"] and isinstance(r.json()["error"], str)


def test_p1_delete_reads_a_form_typed_body_as_json(server_live: Any) -> None:
    """P1: as every ``/api/`` body, a ``curl -X DELETE -d`` body is JSON."""
    r = httpx.request("DELETE", server_live.url + "/api/delete",
                      content=json.dumps({"model": "nope"}),
                      headers={"content-type": "application/x-www-form-urlencoded"}, timeout=30)
    assert r.status_code == 404 and "nope" in r.json()["error"]


def test_p1_pull_with_several_models_routes_by_name_and_loads_nothing() -> None:
    """P1: with several models (``--model`` repeated) a pull of any served name succeeds and
    loads nothing (a pull downloads; it does not load); another name is a 404 naming them."""
    from coda.engine.types import EngineConfig
    from coda.server.app import create_app
    from coda.server.model_router import build_router
    from coda.server.model_specs import ModelSpec
    from tests.conftest import LiveServer

    router = build_router([ModelSpec(None, "x"), ModelSpec(None, "y")],
                          EngineConfig(max_num_seqs=2, kv_cache_bytes=4 << 20))
    server = LiveServer(create_app(cast(Any, router))).start()  # NOTE: an Engine by protocol
    try:
        client = ollama.Client(host=server.url)
        for name in ("x", "y:latest"):
            assert client.pull(name, stream=False).status == "success"
        with pytest.raises(ollama.ResponseError) as e:
            client.pull("z", stream=False)
        assert e.value.status_code == 404 and "'x'" in e.value.error and "'y'" in e.value.error
        models = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
        assert {m["coda_model"]["status"] for m in models} == {"unloaded"}
    finally:
        server.stop()
