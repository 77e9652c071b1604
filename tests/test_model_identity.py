"""``model_snapshot`` is a content identity of what produces the output (issue 8; SPEC P1, P3):
weights' bytes, tokenizer, chat template, serving dtype / quantization, Coda version — shown in
the start event, the ``coda`` object and ``/v1/models``."""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coda.engine.async_engine import AsyncEngine
from coda.engine.types import EngineConfig, GenerationRequest
from coda.models.identity import digest_chunks, digest_files, digest_files_soon, model_identity
from coda.models.loader import safetensors_files
from coda.models.modes import folder_identity


@given(st.lists(st.binary(max_size=3000), max_size=5))
def test_p1_digest_files_streams_equal_to_a_whole_read_oracle(blobs: list[bytes]) -> None:
    """The streamed digest equals sha256 over (length, bytes) of each whole file, and equals
    digest_chunks of the same bytes (one framing for files and tensors)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        paths = []
        for i, b in enumerate(blobs):
            p = Path(d) / f"w{i}"
            p.write_bytes(b)
            paths.append(p)
        oracle = hashlib.sha256(b"".join(len(b).to_bytes(8, "big") + b for b in blobs))
        assert digest_files(paths) == oracle.hexdigest() == digest_chunks(blobs)


def test_p1_digest_files_soon_is_digest_files_and_hands_over_its_error(tmp_path: Path) -> None:
    """P1, issue 19 item 2: the GGUF load hashes its file in a background thread beside the
    other steps; the digest it hands back is digest_files', and a file it cannot read raises
    there (at the join), not in the thread."""
    a = tmp_path / "a"
    a.write_bytes(bytes(range(256)) * 5000)
    assert digest_files_soon([a])() == digest_files([a])
    missing = digest_files_soon([tmp_path / "missing"])
    with pytest.raises(FileNotFoundError):
        missing()


def test_p1_a_settled_files_digest_is_remembered_and_a_changed_file_is_hashed_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """P1, issue 19 item 2: a warm start reads the digest of an unchanged file from the cache
    (no hash: the hash here raises); a file whose size, mtime or inode changed is hashed
    again, and the digest is always digest_files' of the bytes now."""
    import coda.models.identity as ident

    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(ident, "_SETTLED_S", -1.0)  # NOTE: the file counts as old
    f = tmp_path / "w.gguf"
    f.write_bytes(b"a" * 1000)
    first = digest_files_soon([f])()
    assert first == digest_files([f])

    def no_hash(paths: object) -> str:
        raise AssertionError("hashed although the file is unchanged")

    real = ident.digest_files
    monkeypatch.setattr(ident, "digest_files", no_hash)
    assert digest_files_soon([f])() == first
    monkeypatch.setattr(ident, "digest_files", real)
    f.write_bytes(b"a" * 999 + b"b")  # NOTE: same size; the mtime set apart explicitly
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert digest_files_soon([f])() == digest_files([f]) != first
    f.write_bytes(b"a" * 1001)
    assert digest_files_soon([f])() == digest_files([f])
    moved = tmp_path / "new"
    moved.write_bytes(b"c" * 1000)
    os.replace(moved, f)  # NOTE: another inode at the same path
    assert digest_files_soon([f])() == digest_files([f])


def test_p1_a_file_changed_just_now_is_not_remembered(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """P1: a file written within the settling time is hashed but not remembered (its next
    change could fall in the same timestamp tick and keep the key)."""
    import coda.models.identity as ident

    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(ident, "_SETTLED_S", 3600.0)
    f = tmp_path / "w.gguf"
    f.write_bytes(b"x" * 100)
    assert digest_files_soon([f])() == digest_files([f])
    assert not (tmp_path / "cache" / "digests").exists()


def test_p1_framing_moving_bytes_between_shards_changes_the_digest(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"xy")
    b.write_bytes(b"z")
    first = digest_files([a, b])
    a.write_bytes(b"x")
    b.write_bytes(b"yz")
    assert digest_files([a, b]) != first


def test_p1_every_part_changes_the_snapshot() -> None:
    base = model_identity(weights_sha256="0" * 64, tokenizer="{}", chat_template="T",
                          dtype="float32", quantization=None, version="1.0")
    assert base.snapshot == replace(base).snapshot and base.snapshot.startswith("sha256:")
    variants = [
        model_identity(weights_sha256="1" * 64, tokenizer="{}", chat_template="T",
                       dtype="float32", version="1.0"),
        model_identity(weights_sha256="0" * 64, tokenizer="{ }", chat_template="T",
                       dtype="float32", version="1.0"),
        model_identity(weights_sha256="0" * 64, tokenizer="{}", chat_template=None,
                       dtype="float32", version="1.0"),
        model_identity(weights_sha256="0" * 64, tokenizer="{}", chat_template="T",
                       dtype="bfloat16", version="1.0"),
        model_identity(weights_sha256="0" * 64, tokenizer="{}", chat_template="T",
                       dtype="float32", quantization="Q4_1", version="1.0"),
        model_identity(weights_sha256="0" * 64, tokenizer="{}", chat_template="T",
                       dtype="float32", version="1.1"),
    ]
    snaps = {v.snapshot for v in variants}
    assert len(snaps) == len(variants) and base.snapshot not in snaps


def test_p1_folder_identity_is_content_not_name(server_checkpoint: Path, tmp_path: Path) -> None:
    """A renamed copy has the same snapshot; a copy with one weight byte changed does not."""
    same = tmp_path / "renamed"
    shutil.copytree(server_checkpoint, same)
    assert folder_identity(same, "float32") == folder_identity(server_checkpoint, "float32")
    assert folder_identity(same, "float32").weights_sha256 == digest_files(
        safetensors_files(server_checkpoint))
    weights = safetensors_files(same)[0]
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert folder_identity(same, "float32").snapshot != \
        folder_identity(server_checkpoint, "float32").snapshot


def test_p1_start_event_terminal_and_coda_object(server_engine: AsyncEngine) -> None:
    snap = server_engine.model_snapshot
    mode = server_engine.loaded.mode.name  # NOTE: auto's (fp32-kernel where coda._native runs)
    assert snap == folder_identity(server_engine.model_dir, "float32", quant_mode=mode).snapshot
    h = server_engine.submit(GenerationRequest((5, 6, 7), max_tokens=2))
    term = h.wait(30)
    start = h.stream.events_after(-1)[0]
    assert start.model_snapshot == snap and term.model_snapshot == snap


def test_p1_models_endpoint_and_coda_object(server_live: Any) -> None:
    client = openai.OpenAI(base_url=server_live.url + "/v1", api_key="k", max_retries=0)
    card = client.models.list().data[0].model_extra["coda"]  # type: ignore[index]
    assert card["model_snapshot"].startswith("sha256:") and card["dtype"] == "float32"
    assert len(card["weights_sha256"]) == 64 and card["coda_version"]
    r = client.chat.completions.create(model="tiny-chat", max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].model_extra["coda"]["model_snapshot"] == card["model_snapshot"]  # type: ignore[index]


def test_p1_engine_config_dtype_is_part_of_the_identity(server_checkpoint: Path) -> None:
    cfg = EngineConfig(num_blocks=8)
    a = AsyncEngine.from_model_dir(server_checkpoint, cfg)
    assert a.identity.dtype == "float32"
    assert folder_identity(server_checkpoint, "bfloat16").snapshot != a.model_snapshot


def test_p1_a_damaged_digest_cache_entry_is_hashed_again_not_a_failed_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """P1: a cache entry that is not ASCII (a damaged disk, a stray write) is a miss: the file
    is hashed and the entry rewritten. It was a UnicodeDecodeError, which the CLI reported as
    "cannot load model" on every run until the cache was deleted."""
    import coda.models.identity as ident

    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(ident, "_SETTLED_S", -1.0)  # NOTE: the file counts as old
    f = tmp_path / "w.gguf"
    f.write_bytes(b"a" * 1000)
    digest = digest_files_soon([f])()
    entries = list((tmp_path / "cache" / "digests").iterdir())
    assert len(entries) == 1
    entries[0].write_bytes(b"\xff\xfe garbage")
    assert digest_files_soon([f])() == digest
    assert entries[0].read_text(encoding="ascii") == digest
