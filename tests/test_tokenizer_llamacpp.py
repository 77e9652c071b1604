"""Coda's GGUF tokenizers give llama.cpp's ids (K1; issue 19 item 1: the tokenizer equals
llama.cpp's on a multilingual corpus, a generated 262k SentencePiece vocabulary included).

llama.cpp is the reference for GGUF tokenizer metadata but takes minutes to build, so CI
checks against its recorded answers: ``tests/data/tokenizer_llamacpp.jsonl`` is written by
``python scripts/check_gguf_tokenizer.py --record tests/data/tokenizer_llamacpp.jsonl``
(llama-cpp-python 0.3.36, ``vocab_only``), one line per (model, text) with llama.cpp's ids and
one per model with its end-of-generation set. Re-record after changing the corpus.
"""

from __future__ import annotations

import importlib.metadata as md
import json
from collections import defaultdict
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from coda.models.gguf_header import read_header
from coda.models.source import resolve_model
from coda.models.tokenizer_bundle import TokenizerBundle, bundle_from_gguf
from tests.spm_vocab_fixture import write_spm_vocab_gguf

RECORD = Path(__file__).parent / "data" / "tokenizer_llamacpp.jsonl"


def _record() -> dict[str, list[dict[str, Any]]]:
    by_model: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for line in RECORD.read_text().splitlines():
        row = json.loads(line)
        by_model[row["model"]].append(row)
    return by_model


ROWS = _record()


@cache
def _bundle(model: str, scratch: Path) -> TokenizerBundle:
    if model == "generated":
        path = write_spm_vocab_gguf(scratch / "generated-spm-262k.gguf")
    else:
        path = resolve_model(model).path
    return bundle_from_gguf(read_header(path))


def _installed(model: str) -> bool:
    if model == "generated":
        return True
    try:
        md.distribution(model)
    except md.PackageNotFoundError:
        return False
    return True


# NOTE: the generated vocabulary leaves corpus characters out of the vocabulary while pieces
# holding them stay in: llama.cpp merges through them ("日" + "本" -> "日本" with no "日" token),
# which a BPE table of piece pairs cannot (3 of its corpus lines differed before gguf_spm).
@pytest.mark.parametrize("model", sorted(ROWS))
def test_k1_gguf_tokenizer_ids_equal_llama_cpps(model: str,
                                                tmp_path_factory: pytest.TempPathFactory) -> None:
    if not _installed(model):
        pytest.skip(f"{model} is not installed")
    bundle = _bundle(model, tmp_path_factory.mktemp("vocab"))
    tok = bundle.tokenizer
    texts = [r for r in ROWS[model] if "text" in r]
    assert len(texts) >= 20
    diffs = []
    for row in texts:
        ids = tok.encode(row["text"], add_special_tokens=False).ids
        if ids != row["ids"]:
            diffs.append((row["text"][:40], ids, row["ids"]))
        # K2: the ids decode to the text's own bytes where llama.cpp's do
        assert tok.decode(ids, skip_special_tokens=False) == tok.decode(row["ids"],
                                                                        skip_special_tokens=False)
    assert not diffs, diffs[:3]
    (eog,) = [r["eog"] for r in ROWS[model] if "eog" in r]
    assert set(eog) == set(bundle.eos_token_ids)
