"""Issue 18 (memory): a tensor copied at load gives its mapped file pages back, so a model
holds it once, not twice (``coda.models.mapped_pages``); what still reads the map in place
reads the same bytes."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from coda.models import gguf_packed, gguf_weights
from coda.models.gguf_file import open_gguf
from coda.models.gguf_weights import dequantize
from coda.models.mapped_pages import release_pages, whole_pages
from coda.models.source import open_model, resolve_model
from tests.kquant_files import write_mixed

PAGE = mmap.PAGESIZE
linux = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/smaps")


def resident(path: Path) -> int:
    """Bytes of ``path``'s mappings resident in this process (smaps' Rss lines)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total


@given(st.integers(0, 1 << 20), st.integers(0, 1 << 16), st.sampled_from([4096, 16384]))
def test_whole_pages_is_the_largest_aligned_range_inside(address: int, nbytes: int,
                                                         page: int) -> None:
    start, length = whole_pages(address, nbytes, page)
    inside = [p for p in range(address - address % page, address + nbytes + page, page)
              if p >= address and p + page <= address + nbytes]  # NOTE: brute force
    assert (start, length) == ((inside[0], len(inside) * page) if inside else (start, 0))


@linux
def test_release_pages_drops_a_read_only_maps_pages_and_keeps_its_bytes(tmp_path: Path) -> None:
    path = tmp_path / "w.bin"
    data = np.random.default_rng(0).integers(0, 256, 64 * PAGE + 100, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    assert int(mapped.sum(dtype=np.int64)) == int(data.sum(dtype=np.int64))  # touch every page
    before = resident(path)
    assert before >= 64 * PAGE
    view = mapped[50:]  # NOTE: not page-aligned at either end: partial pages are kept
    released = release_pages(view)
    assert released == 63 * PAGE  # NOTE: [base + 50, base + 64 pages + 100): 63 whole pages
    assert resident(path) <= before - released + PAGE
    assert np.array_equal(np.asarray(mapped), data)  # read back from the file, unchanged


def test_release_pages_leaves_owned_and_writable_arrays_alone(tmp_path: Path) -> None:
    owned = np.arange(PAGE * 4, dtype=np.uint8)
    assert release_pages(owned) == 0 and owned[PAGE * 2 + 7] == (PAGE * 2 + 7) % 256
    path = tmp_path / "rw.bin"
    path.write_bytes(bytes(PAGE * 4))
    for mode in ("r+", "c"):  # NOTE: "c": private copy-on-write, whose writes a release loses
        rw = np.memmap(path, dtype=np.uint8, mode=mode)
        rw[:] = 9
        assert release_pages(rw) == 0 and int(rw[PAGE * 3]) == 9


@linux
@pytest.mark.parametrize(("qtype", "quant"), [("Q8_0", "packed"), ("Q4_0", "packed-q8")])
def test_a_packed_model_keeps_no_page_of_its_copied_tensors(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           qtype: str, quant: str) -> None:
    """Every matrix of a type the mode re-lays out (Q8_0, Q4_0), the head tied to the
    embeddings, which the model keeps reading in place (so the map lives on):
    after load the file's resident pages are a small part of it (the header and pages the
    vectors share), not every tensor read for the copies; the embeddings, gathered in place
    from the released pages, give the bytes a load that releases nothing gives."""
    path = write_mixed(tmp_path / "q.gguf", lambda name: qtype, tied=True,
                       dims=(512, 1024, 2, 8, 4, 64), vocab=2015)
    size = path.stat().st_size
    loaded = open_model(resolve_model(str(path)), quant=quant)
    assert resident(path) < 0.15 * size, (resident(path), size)
    ids = torch.arange(0, loaded.config.vocab_size, 7)
    got = loaded.model.model.embed_tokens(ids)
    logits = loaded.model.logits_head(got[:3])
    monkeypatch.setattr(gguf_packed, "release_pages", lambda data: 0)
    monkeypatch.setattr(gguf_weights, "release_pages", lambda data: 0)
    kept = open_model(resolve_model(str(path)), quant=quant)
    assert resident(path) > 0.9 * size  # NOTE: the control: without the release, all stays
    assert torch.equal(kept.model.model.embed_tokens(ids), got)
    assert torch.equal(kept.model.logits_head(got[:3]), logits)


@linux
def test_dequantizing_a_tensor_gives_its_pages_back(tmp_path: Path) -> None:
    """A tensor dequantized to float32 (norms in every mode, everything in ``--quant fp32``)
    is a copy: its mapped pages leave the resident set while the map lives on (the packed
    modes keep it for their in-place tensors); the copy equals gguf-py's dequantization."""
    path = write_mixed(tmp_path / "k.gguf", lambda name: "Q4_K",
                       dims=(512, 1024, 2, 8, 4, 64), vocab=2015)
    ckpt = open_gguf(path)
    t = max(ckpt.tensors(), key=lambda t: t.data.nbytes)
    assert int(np.asarray(t.data).sum(dtype=np.int64)) >= 0  # NOTE: every page resident
    before = resident(path)
    w = dequantize(t)
    assert resident(path) <= before - t.data.nbytes + 2 * PAGE
    expect = gguf.quants.dequantize(np.asarray(t.data), gguf.GGMLQuantizationType.Q4_K)
    assert torch.equal(w, torch.from_numpy(expect.reshape(t.shape)[t.row_order]
                                           if t.row_order is not None else
                                           expect.reshape(t.shape)))
