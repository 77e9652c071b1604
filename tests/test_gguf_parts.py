"""A model published as chunk packages is found by its package name and assembled once, whole
and checked, into the cache (issue 19 item 4: the names a user would type)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from coda.models.config import ModelLoadError
from coda.models.source import resolve_model


def _dist(site: Path, name: str, files: dict[str, bytes], requires: tuple[str, ...] = ()) -> None:
    """An installed distribution as pip leaves it: dist-info with METADATA and RECORD."""
    info = site / f"{name.replace('-', '_')}-1.0.dist-info"  # as pip names it
    info.mkdir(parents=True)
    meta = ["Metadata-Version: 2.1", f"Name: {name}", "Version: 1.0"]
    meta += [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(meta) + "\n")
    record = []
    for rel, data in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(data)
        record.append(f"{rel},,")
    (info / "RECORD").write_text("\n".join(record) + "\n")


@pytest.fixture()
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    s = tmp_path / "site"
    s.mkdir()
    monkeypatch.syspath_prepend(str(s))
    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path / "cache"))
    return s


BODY = bytes(range(256)) * 41  # stands in for a GGUF: the assembly is byte-level


def _publish(site: Path, *, sha: str | None = None, skip: int | None = None) -> None:
    cuts = [0, 3000, 7000, len(BODY)]
    parts = {f"tiny_model_part{i + 1}/data/tiny.gguf.part{i:02d}": BODY[cuts[i]:cuts[i + 1]]
             for i in range(3) if i != skip}
    for i, (rel, data) in enumerate(parts.items()):
        _dist(site, f"tiny_model_part{i + 1}", {rel: data})
    sums = sha if sha is not None else hashlib.sha256(BODY).hexdigest()
    _dist(site, "tiny-model", {"tiny_model/data/SHA256SUMS": f"{sums}  tiny.gguf\n".encode()},
          requires=tuple(f"tiny_model_part{i + 1}>=1.0" for i in range(len(parts))))


def test_chunked_package_resolves_to_one_assembled_file_reused_later(site: Path) -> None:
    _publish(site)
    src = resolve_model("tiny-model")
    assert src.kind == "gguf" and src.path.read_bytes() == BODY
    assert src.path.parent == Path(os.environ["CODA_CACHE_DIR"]) / "gguf"
    assert {"tiny-model", "tiny"} <= src.aliases
    stamp = src.path.stat().st_mtime_ns
    again = resolve_model("tiny_model")  # the other spelling a user types
    assert again.path == src.path and again.path.stat().st_mtime_ns == stamp  # not rewritten


def test_a_damaged_assembly_is_refused_and_leaves_no_file(site: Path) -> None:
    _publish(site, sha="0" * 64)
    with pytest.raises(ModelLoadError, match="sha256"):
        resolve_model("tiny-model")
    assert not list((Path(os.environ["CODA_CACHE_DIR"]) / "gguf").iterdir())


def test_a_missing_chunk_package_is_named(site: Path) -> None:
    _publish(site, skip=1)
    with pytest.raises(ModelLoadError, match="missing"):
        resolve_model("tiny-model")


def test_a_truncated_cached_copy_is_assembled_again(site: Path) -> None:
    _publish(site)
    path = resolve_model("tiny-model").path
    path.write_bytes(BODY[:100])  # e.g. a disk that filled up outside Coda
    assert resolve_model("tiny-model").path.read_bytes() == BODY




def test_coda_models_lists_a_chunked_package_before_and_after_assembly(site: Path) -> None:
    """Issue 19 item 5: the umbrella is listed under the name to pass to ``--model`` (its parts'
    packages are not); before the first load it says it is assembled then (nothing is written
    by listing), after it the row describes the assembled file."""
    from coda.models.catalog import gguf_packages, list_models

    _publish(site)
    cache = Path(os.environ["CODA_CACHE_DIR"]) / "gguf"
    found = dict(gguf_packages())
    assert found.get("tiny-model") == [cache / "tiny.gguf"]
    assert not any(name.startswith("tiny_model_part") for name in found)
    row = next(e for e in list_models([]) if e.model == "tiny-model")
    assert "assembled" in row.error and not cache.exists()
    resolve_model("tiny-model")
    row = next(e for e in list_models([]) if e.model == "tiny-model")
    assert row.path == cache / "tiny.gguf" and "assembled" not in row.error
