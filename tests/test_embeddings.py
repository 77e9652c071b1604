"""Embeddings (issue 23 item 2): ``/api/embed``, ``/api/embeddings`` and ``/v1/embeddings``
through the official ``ollama`` and ``openai`` clients on the real SmolLM2 model, against
transformers' hidden states of the same file as the oracle; bad input as a 4xx in each
protocol's shape; an embedding between decode steps changes no request's output (T4, P1) and
leaves every KV block as it was (L7)."""

from __future__ import annotations

import base64
import math
import struct
from typing import Any

import httpx
import ollama
import openai
import pytest
import torch

from coda.engine.types import GenerationRequest
from coda.sampling import SamplingParams
from coda.server.embeddings import normalised

TEXTS = ["The capital of France is Paris.", "def add(a, b):\n    return a + b"]


@pytest.fixture
def name(smollm_engine: Any) -> str:
    return str(smollm_engine.model_name)


@pytest.fixture
def oclient(smollm_live: Any) -> ollama.Client:
    return ollama.Client(host=smollm_live.url)


def _norm(v: list[float]) -> float:
    return math.sqrt(sum(x * x for x in v))


def test_embedding_is_the_mean_of_the_last_hidden_state(smollm_engine: Any, smollm_hf: Any,
                                                        oclient: ollama.Client, name: str
                                                        ) -> None:
    """The raw vector (``/api/embeddings``) is transformers' last hidden state (after the final
    norm) of the same ids, averaged over the tokens; ``/api/embed`` is it at unit norm."""
    ids = smollm_engine.tokenizer.encode(TEXTS[0], add_special_tokens=True).ids
    with torch.no_grad():
        out = smollm_hf(torch.tensor([ids]), output_hidden_states=True)
    want = out.hidden_states[-1][0].double().mean(dim=0)
    raw = oclient.embeddings(model=name, prompt=TEXTS[0]).embedding
    got = torch.tensor(list(raw), dtype=torch.float64)
    assert got.shape == want.shape
    assert torch.allclose(got, want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))
    unit = oclient.embed(model=name, input=TEXTS[0]).embeddings[0]
    assert unit == pytest.approx([x / _norm(list(raw)) for x in raw], rel=1e-6, abs=1e-7)


def test_ollama_embed_many_inputs_dimensions_and_counts(oclient: ollama.Client, name: str,
                                                        smollm_live: Any, smollm_engine: Any
                                                        ) -> None:
    """One unit vector per input, in order, each the single-input answer; ``dimensions``
    keeps the first values and normalises again; the prompt tokens are counted."""
    both = oclient.embed(model=name, input=TEXTS)
    assert len(both.embeddings) == 2
    for text, vec in zip(TEXTS, both.embeddings, strict=True):
        assert list(vec) == list(oclient.embed(model=name, input=text).embeddings[0])
        assert _norm(list(vec)) == pytest.approx(1.0, abs=1e-6)
    assert both.embeddings[0] != both.embeddings[1]
    ids = [smollm_engine.tokenizer.encode(t, add_special_tokens=True).ids for t in TEXTS]
    assert both.prompt_eval_count == sum(len(i) for i in ids)
    short = oclient.embed(model=name, input=TEXTS[0], dimensions=64).embeddings[0]
    assert list(short) == pytest.approx(normalised(list(both.embeddings[0]), 64), abs=1e-6)
    assert len(short) == 64
    empty = httpx.post(smollm_live.url + "/api/embed", json={"model": name}, timeout=60)
    assert empty.status_code == 200 and empty.json()["embeddings"] == []


def test_openai_embeddings_float_base64_and_token_ids(smollm_live: Any, name: str,
                                                      oclient: ollama.Client,
                                                      smollm_engine: Any) -> None:
    """The official client (base64 by default) decodes to the float answer; token ids embed
    as the text they encode; usage counts the tokens."""
    client = openai.OpenAI(base_url=smollm_live.url + "/v1", api_key="x")
    got = client.embeddings.create(model=name, input=TEXTS)
    assert [d.index for d in got.data] == [0, 1]
    want = oclient.embed(model=name, input=TEXTS).embeddings
    for d, w in zip(got.data, want, strict=True):
        assert d.embedding == pytest.approx(list(w), rel=1e-6, abs=1e-7)
    floats = httpx.post(smollm_live.url + "/v1/embeddings", timeout=60, json={
        "model": name, "input": TEXTS[1], "encoding_format": "float"}).json()
    packed = httpx.post(smollm_live.url + "/v1/embeddings", timeout=60, json={
        "model": name, "input": TEXTS[1], "encoding_format": "base64"}).json()
    blob = base64.b64decode(packed["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(blob) // 4}f", blob)) == pytest.approx(
        floats["data"][0]["embedding"], rel=1e-6)
    ids = smollm_engine.tokenizer.encode(TEXTS[1], add_special_tokens=True).ids
    by_ids = client.embeddings.create(model=name, input=[ids], encoding_format="float")
    assert by_ids.data[0].embedding == floats["data"][0]["embedding"]
    assert by_ids.usage.prompt_tokens == by_ids.usage.total_tokens == len(ids)


@pytest.mark.parametrize(("path", "body", "status", "word"), [
    ("/api/embed", {"input": "x" * 40000, "truncate": False}, 400, "context"),
    ("/api/embed", {"input": "hello", "dimensions": 100000}, 400, "dimensions"),
    ("/api/embed", {"input": ["hello", ""]}, 400, "input"),
    ("/api/embed", {"input": "hello", "nope": 1}, 400, "nope"),
    ("/api/embed", {"input": "hello", "model": "no-such"}, 404, "no-such"),
    ("/api/embeddings", {"input": "hello"}, 400, "prompt"),
    ("/v1/embeddings", {"input": []}, 400, "input"),
    ("/v1/embeddings", {"input": [[10 ** 9]]}, 400, "vocabulary"),
    ("/v1/embeddings", {"input": "x" * 40000}, 400, "context"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
])
def test_bad_input_is_a_4xx_in_the_protocols_shape(smollm_live: Any, name: str, path: str,
                                                   body: dict[str, Any], status: int,
                                                   word: str) -> None:
    resp = httpx.post(smollm_live.url + path, json={"model": name, **body}, timeout=60)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    text = err if path.startswith("/api/") else err["message"]
    assert word in text


def test_ollama_truncate_cuts_to_the_context(smollm_live: Any, name: str,
                                             smollm_engine: Any) -> None:
    """``truncate`` (on by default): an input past the context embeds its first tokens."""
    long = "word " * (smollm_engine.context_length * 2)
    resp = httpx.post(smollm_live.url + "/api/embed", timeout=120,
                      json={"model": name, "input": long})
    assert resp.status_code == 200
    assert resp.json()["prompt_eval_count"] == smollm_engine.context_length


def test_embedding_between_steps_changes_no_output_t4_l7(smollm_engine: Any) -> None:
    """Embeddings run on the engine thread between decode steps: a seeded request decoded
    while embeddings run gives the tokens and logprobs it gives alone, the embedding equals
    one taken on an idle engine, and every KV block is free afterwards."""
    prompt = smollm_engine.tokenizer.encode("Once upon a time", add_special_tokens=True).ids

    def run() -> Any:
        handle = smollm_engine.submit(GenerationRequest(
            prompt_token_ids=tuple(prompt), max_tokens=24,
            sampling=SamplingParams(temperature=0.8, seed=11, logprobs=1, ignore_eos=True)))
        return handle

    def tokens(handle: Any) -> list[tuple[int, float | None]]:
        handle.wait(120)
        return [(t.token_id, t.logprob) for e in handle.stream.events_after(-1)
                for t in e.tokens]

    alone = tokens(run())
    idle = smollm_engine.embed_future(prompt).result(120)
    handle = run()
    busy = [smollm_engine.embed_future(prompt) for _ in range(4)]
    crowded = tokens(handle)
    assert [f.result(120) for f in busy] == [idle] * 4
    assert len(alone) == 24 and crowded == alone
    stats = smollm_engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
