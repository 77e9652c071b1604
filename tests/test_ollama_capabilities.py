"""Ollama ``/api/show`` ``capabilities`` say what the model is, as Ollama decides it (SPEC P1).

Ollama lists ``embedding`` for an embedding model alone (one with a pooling type) and
``completion`` for a generative one, ``thinking`` when its template reasons; clients (the
``ollama`` CLI, model pickers) choose embedding models by it. Coda serves generative models:
``completion`` and ``tools`` (Coda's tool calling serves every model), ``thinking`` when the
model has the reasoning markers — never ``embedding``, although ``/api/embed`` still embeds
with any model, as Ollama's own ``/api/embed`` does. Before, every model listed
``embedding`` and none ``thinking``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import ollama
import pytest

from tests.reasoning_support import CHAIN, reasoning_server
from tests.test_server_openai import MODEL
from tests.wire_support import ScriptedServer


@pytest.fixture(scope="module")
def r1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScriptedServer]:
    yield from reasoning_server(tmp_path_factory, CHAIN, inside=True)


def test_p1_a_generative_model_is_completion_and_tools_not_embedding(server_live: Any
                                                                      ) -> None:
    """P1 (official client): a chat model without reasoning markers shows ``completion``
    and ``tools``; ``/api/embed`` still answers for it."""
    client = ollama.Client(host=server_live.url)
    assert client.show(MODEL).capabilities == ["completion", "tools"]
    assert len(client.embed(model=MODEL, input="hi").embeddings[0]) > 0


def test_p1_a_reasoning_model_shows_thinking(r1: ScriptedServer) -> None:
    """P1 (official client): a model with ``<think>`` markers also shows ``thinking`` (the
    capability ``think: true`` needs), still no ``embedding``."""
    client = ollama.Client(host=r1.url)
    name = client.list().models[0].model
    assert name is not None
    assert client.show(name).capabilities == ["completion", "tools", "thinking"]
