"""A raw prompt's BOS, once (K2, L6): a completion prompt, an Ollama ``raw`` generate, an
embedding input and ``coda generate``'s prompt get the special tokens the tokenizer adds (the
BOS of Gemma's and Llama's files), and a text that already opens with the BOS keeps its own
and gets no second one (found on Gemma 3 270M: ``"<bos>Hello"`` was prompted as
``<bos><bos>Hello``, a sequence start mid-sequence). Served over loopback with the official
``openai`` and ``ollama`` clients; the tiny GGUF's tokenizer adds ``<|im_start|>`` as its BOS.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ollama
import openai
import pytest
from typer.testing import CliRunner

from coda.cli import app
from tests.conftest import LiveServer
from tests.openai_sweep_support import GEMMA
from tests.test_gguf_tiny import write_gguf

BOS = "<|im_start|>"


def _serve(model: str | Path) -> Iterator[str]:
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.server.app import create_app

    engine = AsyncEngine.from_model_dir(model, EngineConfig(
        max_num_seqs=2, kv_cache_bytes=32 * 2**20, max_model_len=256, default_max_tokens=2))
    engine.start()
    live = LiveServer(create_app(engine, manage_engine=False)).start()
    try:
        yield live.url
    finally:
        live.stop()
        engine.shutdown()


@pytest.fixture(scope="module")
def bos_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("bos") / "bos.gguf", "llama", bos=True)


@pytest.fixture(scope="module")
def url(bos_gguf: Path) -> Iterator[str]:
    yield from _serve(bos_gguf)


def _echo_tokens(url: str, prompt: str) -> tuple[list[str], int]:
    oa = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
    model = oa.models.list().data[0].id
    r = oa.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    lp: Any = r.choices[0].logprobs
    assert r.choices[0].text == prompt and r.usage is not None
    return list(lp.tokens), r.usage.prompt_tokens


def test_k2_completion_prompt_gets_the_bos_once(url: str) -> None:
    """K2/L6: ``"the"`` is prompted as BOS + its tokens; ``"<BOS>the"`` as the same ids, not
    with a second BOS; ``"<BOS><BOS>the"`` keeps the two the text has (no third)."""
    plain, n = _echo_tokens(url, "the")
    assert plain[0] == BOS and BOS not in plain[1:] and n == len(plain)
    assert _echo_tokens(url, BOS + "the") == (plain, n)
    assert _echo_tokens(url, BOS + BOS + "the") == ([BOS, *plain], n + 1)


def test_l6_ollama_raw_generate_and_embed_count_one_bos(url: str) -> None:
    """L6: Ollama's ``raw`` generate and ``/api/embed`` encode a raw prompt the same way: a
    prompt opening with the BOS is counted with one."""
    client = ollama.Client(host=url)
    model = client.list().models[0].model
    assert model is not None

    def count(prompt: str) -> int | None:
        r = client.generate(model=model, prompt=prompt, raw=True, options={"num_predict": 1})
        return r.prompt_eval_count

    assert count(BOS + "the") == count("the") is not None
    embed = client.embed(model=model, input=[BOS + "the", "the"])
    assert embed.prompt_eval_count == 2 * (count("the") or 0)
    assert embed.embeddings[0] == embed.embeddings[1]


def test_k2_cli_generate_prompt_opening_with_the_bos_gets_no_second(bos_gguf: Path) -> None:
    """K2/L6: ``coda generate "<BOS>the"`` prompts the ids of ``coda generate the``."""
    def prompt_tokens(prompt: str) -> str:
        res = CliRunner().invoke(app, ["generate", prompt, "--model", str(bos_gguf),
                                       "--max-tokens", "1", "--quant", "fp32"])
        assert res.exit_code == 0, res.output
        return res.output.split('"prompt_tokens": ')[1].split(",")[0]

    assert prompt_tokens(BOS + "the") == prompt_tokens("the")


@pytest.mark.skipif(not GEMMA.exists(), reason=f"{GEMMA} is not here")
def test_k2_gemma_completion_prompt_opening_with_bos_has_one() -> None:
    """K2: Gemma 3 270M (its GGUF adds ``<bos>``): ``"<bos>Hello"`` echoes as
    ``<bos>``, ``Hello`` — the ids of ``"Hello"``."""
    for url in _serve(GEMMA):
        assert _echo_tokens(url, "<bos>Hello") == (["<bos>", "Hello"], 2)
        assert _echo_tokens(url, "Hello") == (["<bos>", "Hello"], 2)


def test_o1_echo_text_offset_moves_for_special_tokens_the_prompt_writes(url: str) -> None:
    """O1 (echo): ``text_offset`` indexes the echoed text, the prompt as sent: a special token
    the text writes (``<|endoftext|>``, a ``<BOS>`` it opens with) is text there and moves
    the offset; the BOS the tokenizer added is not (found on SmolLM2: ``"<|endoftext|>Hello"``
    gave offsets ``[0, 0, 18, …]``, ``Hello`` at 0 in a text where it starts at 13), with
    ``skip_special_tokens`` either way."""
    oa = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
    model = oa.models.list().data[0].id
    for skip in (True, False):
        for prompt, offsets in (("<|endoftext|>the", [0, 0, 13, 14]),
                                (BOS + "the", [0, 12, 13]),
                                ("t<|im_end|>he", [0, 0, 1, 11])):
            r = oa.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True,
                                      logprobs=0, extra_body={"skip_special_tokens": skip})
            lp: Any = r.choices[0].logprobs
            assert r.choices[0].text == prompt
            assert lp.text_offset == offsets, (prompt, skip, lp.tokens)
            for token, start in zip(lp.tokens, offsets, strict=True):
                assert token == BOS and start == 0 or prompt.startswith(token, start)
