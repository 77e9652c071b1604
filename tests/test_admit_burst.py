"""A burst is admitted into the free batch slots (docs/api.md, "Overload"; SPEC L5).

A request waits only when no batch slot is free for it: ``Engine.num_queued`` counts the
accepted requests past the ``max_num_seqs`` slots free, not every request a step has yet to
admit. Before, on an idle ``coda serve --max-num-seqs 16 --max-waiting 24`` a burst of 40
streams got 7-15 429s, because each counted as waiting until the engine's next step took it.
The engine thread is held here (an embedding running on it), so no step admits anything while
the burst arrives: what is accepted depends on the admission rule alone, never on timing.
The 429 is OpenAI's overloaded answer (``type: "server_error"``, not the request's fault),
Anthropic's 529 ``overloaded_error``, Ollama's own busy answer (503 ``{"error"}``), through the
official clients.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anthropic
import ollama
import openai
import pytest

from coda.server.state import ServerSettings
from tests.conftest import LiveServer

MODEL = "tiny-chat"
SLOTS, BOUND = 2, 3


@pytest.fixture
def held(server_checkpoint: Path) -> Iterator[tuple[Any, LiveServer, threading.Event]]:
    """An engine of ``SLOTS`` batch slots behind ``max_waiting=BOUND``, its thread held by an
    embedding until the yielded event is set (then the embedding ends and steps run)."""
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.server.app import create_app

    engine = AsyncEngine.from_model_dir(server_checkpoint, EngineConfig(max_num_seqs=SLOTS,
                                                                        num_blocks=128))
    live = LiveServer(create_app(engine, settings=ServerSettings(max_waiting=BOUND))).start()
    release, running = threading.Event(), threading.Event()
    forward = engine.runner.embed_rows

    def hold(*args: Any) -> Any:
        running.set()
        release.wait(60)
        return forward(*args)

    engine.runner.embed_rows = hold
    try:
        engine.embed_future([5, 6, 7])
        assert running.wait(30), "the engine thread never ran the holding embedding"
        yield engine, live, release
    finally:
        release.set()
        live.stop()


def _client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="k", max_retries=0, timeout=60)


def test_a_burst_of_slots_plus_bound_is_all_accepted_and_one_more_is_refused_l5(
        held: tuple[Any, LiveServer, threading.Event]) -> None:
    """L5: no step runs while ``SLOTS + BOUND`` streams arrive: all are accepted (the first
    ``SLOTS`` take the free slots, ``BOUND`` wait), and one more is the 429 in each protocol's
    shape, OpenAI's ``server_error`` type included. Released, every accepted stream runs its
    whole budget and ends once (``length``, 3 tokens billed): nothing accepted is lost."""
    engine, live, release = held
    ends: list[tuple[str | None, int]] = []
    refused: list[BaseException] = []

    def stream_one() -> None:
        try:
            # NOTE: ignore_eos: a random model may sample EOS first, an honest empty answer;
            # the check is that every accepted stream runs its whole budget and ends once.
            chunks = list(_client(live).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True}))
            reasons = [c.choices[0].finish_reason for c in chunks
                       if c.choices and c.choices[0].finish_reason]
            usage = [c.usage.completion_tokens for c in chunks if c.usage]
            ends.append((reasons[0] if len(reasons) == 1 else None, sum(usage)))
        except openai.APIError as exc:
            refused.append(exc)

    burst = [threading.Thread(target=stream_one) for _ in range(SLOTS + BOUND)]
    for t in burst:
        t.start()
    deadline = time.monotonic() + 30
    while engine.num_waiting() + len(refused) < SLOTS + BOUND and time.monotonic() < deadline:
        time.sleep(0.01)
    assert refused == [], f"a burst within slots + bound was refused: {refused}"
    assert engine.num_waiting() == SLOTS + BOUND  # NOTE: no step has admitted any yet
    assert engine.num_queued() == BOUND and engine.num_queued(1) == BOUND + 1

    with pytest.raises(openai.RateLimitError) as err:
        _client(live).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert err.value.code == "overloaded" and err.value.type == "server_error"
    assert err.value.response.headers["retry-after"] == "1"
    with pytest.raises(anthropic.OverloadedError) as aerr:
        anthropic.Anthropic(base_url=live.url, api_key="k", max_retries=0).messages.create(
            model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert aerr.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    with pytest.raises(ollama.ResponseError) as oerr:
        ollama.Client(host=live.url).generate(model=MODEL, prompt="hi",
                                              options={"num_predict": 3})
    assert oerr.value.status_code == 503 and "overloaded" in oerr.value.error

    release.set()
    for t in burst:
        t.join(60)
    assert refused == [] and ends == [("length", 3)] * (SLOTS + BOUND)


def test_a_queued_embedding_waits_whatever_the_slots_l5(
        held: tuple[Any, LiveServer, threading.Event]) -> None:
    """L5: an embedding holds no batch slot, so one queued behind the running one waits
    though every slot is free: with ``BOUND`` of them queued, one more embedding is the 429,
    while a chat, which a free slot takes, is still accepted."""
    engine, live, release = held
    futures = [engine.embed_future([1, 2]) for _ in range(BOUND)]
    assert engine.num_queued() == BOUND
    with pytest.raises(openai.RateLimitError) as err:
        _client(live).embeddings.create(model=MODEL, input="hi")
    assert err.value.code == "overloaded"
    answers: list[object] = []

    def chat_one() -> None:
        try:
            answers.append(_client(live).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2))
        except openai.APIError as exc:
            answers.append(exc)

    chat = threading.Thread(target=chat_one)
    chat.start()
    deadline = time.monotonic() + 30
    while engine.num_waiting() + len(answers) < BOUND + 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.num_queued() == BOUND  # NOTE: the chat takes a free slot, it does not wait
    release.set()
    chat.join(60)
    assert len(answers) == 1 and isinstance(answers[0], openai.types.chat.ChatCompletion)
    assert all(len(f.result(60)) > 0 for f in futures)


def test_several_models_and_replicas_count_past_their_own_slots_l5() -> None:
    """L5: the several-models router counts, per model, its open requests past that model's
    ``max_num_seqs`` (``incoming`` on the selected one); the scale-out ingress per replica,
    ``incoming`` past the slots free on all of them."""
    from coda.scaleout.remote import RemoteEngine
    from coda.server.model_router import ModelRouter

    def handles(**where: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, n in where.items():
            for i in range(n):
                out[f"{key}{i}"] = SimpleNamespace(
                    stream=SimpleNamespace(closed=False), slot=SimpleNamespace(name=key),
                    replica=int(key[1:]) if key.startswith("r") else -1)
        out["ended"] = SimpleNamespace(stream=SimpleNamespace(closed=True),
                                       slot=SimpleNamespace(name="a"), replica=0)
        return out

    a, b = SimpleNamespace(name="a"), SimpleNamespace(name="b")
    router = SimpleNamespace(slots=[a, b], config=SimpleNamespace(max_num_seqs=2),
                             _handles=handles(a=3, b=1), _slot=lambda: b)
    assert ModelRouter.num_queued(router) == 1  # type: ignore[arg-type]
    assert ModelRouter.num_queued(router, 1) == 1  # type: ignore[arg-type]
    assert ModelRouter.num_queued(router, 2) == 2  # type: ignore[arg-type]
    remote = SimpleNamespace(replicas=[0, 1], config=SimpleNamespace(max_num_seqs=2),
                             _live=handles(r0=3, r1=0))
    assert RemoteEngine.num_queued(remote) == 1  # type: ignore[arg-type]
    assert RemoteEngine.num_queued(remote, 2) == 1  # type: ignore[arg-type]
    assert RemoteEngine.num_queued(remote, 3) == 2  # type: ignore[arg-type]
