"""The GGUF load's steps that run beside each other (issue 19 item 2): the file's digest and
the weights' layout in background threads while the tokenizer is built. Errors reach the
caller as they did when the steps ran one after the other."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from coda.models.background import soon
from coda.models.config import UnsupportedModelError
from coda.models.source import ModelSource, open_model
from tests.test_gguf_tiny import write_gguf


def test_soon_hands_back_the_result_and_the_exception_in_the_callers_thread() -> None:
    ran_in: list[str] = []

    def work() -> int:
        ran_in.append(threading.current_thread().name)
        return 42

    assert soon(work, "coda-test")() == 42
    assert ran_in == ["coda-test"]

    def fails() -> int:
        raise KeyError("from the worker")

    waiting = soon(fails, "coda-test")
    with pytest.raises(KeyError, match="from the worker"):
        waiting()


def test_a_bad_tokenizer_is_the_error_a_load_raises_while_the_weights_build_beside_it(
        tmp_path: Path) -> None:
    """A GGUF with good Q4_1 weights (the packed mode's re-layout runs in its thread) and an
    unsupported pre-tokenizer: open_model raises the tokenizer's error, naming it."""
    path = write_gguf(tmp_path / "bad-pre.gguf", "llama", qtype="Q4_1", extra_tokens=4)
    data = path.read_bytes()
    # NOTE: the pre-tokenizer's name ("smollm") swapped for another of the same length
    assert data.count(b"smollm") == 1
    path.write_bytes(data.replace(b"smollm", b"nosuch"))
    with pytest.raises(UnsupportedModelError, match="nosuch"):
        open_model(ModelSource("gguf", path, str(path)))


def test_open_model_of_a_packed_gguf_gives_the_model_and_its_identity(tmp_path: Path) -> None:
    """The weights built in their thread are the model open_model returns (packed, the
    file's Q4_1 blocks), with the digest of the file's bytes as the snapshot's weights part."""
    from coda.models.identity import digest_files

    path = write_gguf(tmp_path / "ok.gguf", "llama", qtype="Q4_1", extra_tokens=4)
    loaded = open_model(ModelSource("gguf", path, str(path)))
    assert loaded.mode.name == "packed"
    assert loaded.identity.weights_sha256 == digest_files([path])
    assert "Q4_1" in loaded.model.kernels
