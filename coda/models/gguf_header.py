"""A GGUF file's header read in one pass, big arrays left unparsed (issue 19 item 2).

``gguf.GGUFReader`` builds a numpy view for every part of every field: a 49k-token vocabulary
costs seconds, a 262k one over half a minute, before a single check can run. :func:`read_header`
walks the same bytes with :mod:`struct` and keeps:

* every scalar and string, and every array of at most :data:`SMALL_ARRAY` entries, parsed
  (``metadata``), in file order;
* for longer arrays (the tokenizer's tokens, scores, merges …) only where they lie: they are
  parsed on first use by :meth:`GGUFHeader.field`;
* the tensor table (:class:`TensorInfo`): name, type, dimensions and where its bytes are. The
  bytes themselves are views of one read-only memory map of the file (:meth:`GGUFHeader.data`),
  so nothing is copied and the pages are shared by every process that maps the file.

A file that is not GGUF, is truncated, or whose counts or offsets point outside it raises
:class:`GGUFFormatError` naming the byte offset. Layout (little-endian, GGUF v2/v3): magic
``GGUF``, version u32, tensor count u64, key-value count u64; each key-value: key string
(u64 length + UTF-8), value type u32, value (an array: element type u32, count u64,
elements); each tensor: name, dimension count u32, dimensions u64 (fastest first), type u32,
offset u64 from the data section, which starts at the next multiple of ``general.alignment``
(default 32). This module does not import torch.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from coda.models.ggml_types import GGML_BLOCK_SIZES, GGMLType

SMALL_ARRAY = 64  # NOTE: arrays up to this many entries are parsed with the header
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
# NOTE: element views of the types numpy holds natively; every other type is raw block bytes
_ELEMENT_DTYPES = {GGMLType.F32: np.float32, GGMLType.F16: np.float16,
                   GGMLType.F64: np.float64, GGMLType.I8: np.int8,
                   GGMLType.I16: np.int16, GGMLType.I32: np.int32,
                   GGMLType.I64: np.int64}


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader understands; the message says where."""


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table. ``dims`` are GGUF's, fastest first (``dims[0]`` is the
    number of columns); ``offset`` is absolute in the file."""

    name: str
    tensor_type: GGMLType
    dims: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.dims)) if self.dims else 1

    @property
    def type_name(self) -> str:
        return self.tensor_type.name


@dataclass(frozen=True)
class _LazyArray:
    element_type: int
    count: int
    offset: int  # of the first element


@dataclass
class GGUFHeader:
    """What :func:`read_header` found; see the module docstring."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    data_offset: int
    _lazy: dict[str, _LazyArray] = field(default_factory=dict, repr=False)
    _map: np.memmap | None = field(default=None, repr=False)
    _parsed: dict[str, Any] = field(default_factory=dict, repr=False)

    def array_length(self, key: str) -> int | None:
        """The number of entries of an array field (parsed or not); None if absent."""
        if key in self._lazy:
            return self._lazy[key].count
        value = self.metadata.get(key)
        return len(value) if isinstance(value, list) else None

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value; a long array is parsed on first use (then kept)."""
        if key in self.metadata:
            return self.metadata[key]
        lazy = self._lazy.get(key)
        if lazy is None:
            return default
        if key not in self._parsed:
            self._parsed[key], _ = _array_values(_view(self.bytes()), lazy.element_type,
                                                 lazy.count, lazy.offset)
        return self._parsed[key]

    def bytes(self) -> np.memmap:
        """The whole file, memory-mapped read-only (one map per header)."""
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._map

    def data(self, t: TensorInfo) -> np.ndarray:
        """The tensor's stored bytes as ``gguf.GGUFReader`` shapes them (no copy): elements
        ``[rows, cols]`` for F32/F16/…, else block bytes ``[rows, bytes per row]``."""
        raw = self.bytes()[t.offset:t.offset + t.nbytes]
        shape = tuple(reversed(t.dims))
        dtype = _ELEMENT_DTYPES.get(t.tensor_type)
        if dtype is not None:
            return raw.view(dtype).reshape(shape)
        block, size = GGML_BLOCK_SIZES[t.tensor_type]
        return raw.reshape(*shape[:-1], shape[-1] // block * size)


def read_header(path: str | Path) -> GGUFHeader:
    """Read ``path``'s header and tensor table (see the module docstring)."""
    path = Path(path)
    try:
        buf = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as exc:
        raise GGUFFormatError(f"cannot map {path}: {exc}") from None
    try:
        return _parse(path, buf, _view(buf))
    except (struct.error, IndexError, UnicodeDecodeError, OverflowError) as exc:
        raise GGUFFormatError(f"{path}: damaged or truncated GGUF header ({exc})") from None


def _parse(path: Path, mapped: np.memmap, buf: memoryview) -> GGUFHeader:
    if buf[:4].tobytes() != b"GGUF":
        raise GGUFFormatError(f"{path} does not start with the GGUF magic")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise GGUFFormatError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    size = len(buf)
    if n_kv > size or n_tensors > size:  # NOTE: each entry takes bytes: a guard on garbage
        raise GGUFFormatError(f"{path}: counts ({n_kv} keys, {n_tensors} tensors) exceed the "
                              f"file's {size} bytes")
    off = 24
    meta: dict[str, Any] = {}
    lazy: dict[str, _LazyArray] = {}
    for _ in range(n_kv):
        key, off = _string(buf, off)
        (vtype,), off = struct.unpack_from("<I", buf, off), off + 4
        if vtype == _ARRAY:
            etype, count = struct.unpack_from("<IQ", buf, off)
            off += 12
            if count > SMALL_ARRAY:
                lazy[key] = _LazyArray(etype, count, off)
                off = _skip_array(buf, etype, count, off)
            else:
                meta[key], off = _array_values(buf, etype, count, off)
        else:
            meta[key], off = _value(buf, vtype, off)
    tensors_at: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(n_tensors):
        name, off = _string(buf, off)
        (n_dims,), off = struct.unpack_from("<I", buf, off), off + 4
        if n_dims > 8:
            raise GGUFFormatError(f"{path}: tensor {name!r} has {n_dims} dimensions")
        dims = struct.unpack_from(f"<{n_dims}Q", buf, off)
        off += 8 * n_dims
        ttype, rel = struct.unpack_from("<IQ", buf, off)
        off += 12
        tensors_at.append((name, tuple(int(d) for d in dims), ttype, rel))
    align = int(meta.get("general.alignment", 32))
    data_offset = -(-off // align) * align
    tensors = [_tensor(path, name, dims, ttype, data_offset + rel, size)
               for name, dims, ttype, rel in tensors_at]
    return GGUFHeader(path, version, meta, tensors, data_offset, lazy, mapped)


def _tensor(path: Path, name: str, dims: tuple[int, ...], ttype: int, offset: int,
            size: int) -> TensorInfo:
    try:
        qtype = GGMLType(ttype)
        block, type_size = GGML_BLOCK_SIZES[qtype]
    except (ValueError, KeyError):
        raise GGUFFormatError(f"{path}: tensor {name!r} has unknown type id {ttype}") from None
    n = int(np.prod(dims)) if dims else 1
    if dims and dims[0] % block:
        raise GGUFFormatError(f"{path}: tensor {name!r} rows of {dims[0]} are not whole "
                              f"{qtype.name} blocks of {block}")
    nbytes = n // block * type_size
    if offset + nbytes > size:
        raise GGUFFormatError(f"{path}: tensor {name!r} ends at byte {offset + nbytes}, past "
                              f"the file's end ({size}): truncated")
    return TensorInfo(name, qtype, dims, offset, nbytes)


def _view(mapped: np.memmap) -> memoryview:
    return memoryview(mapped)  # type: ignore[arg-type]  # NOTE: numpy's stubs lack Buffer


def _string(buf: memoryview, off: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, off)
    off += 8
    if off + n > len(buf):
        raise GGUFFormatError(f"a string of {n} bytes at offset {off} runs past the file's end")
    return buf[off:off + n].tobytes().decode("utf-8"), off + n


_U64 = struct.Struct("<Q").unpack_from


def _strings(buf: memoryview, count: int, off: int) -> tuple[list[str], int]:
    """``count`` length-prefixed UTF-8 strings from ``off`` (a vocabulary: 50k-260k of them,
    so the loop is kept to one unpack, one slice and one decode per string)."""
    out: list[str] = []
    append, unpack, end = out.append, _U64, len(buf)
    try:
        for _ in range(count):
            (n,) = unpack(buf, off)
            off += 8
            if off + n > end:
                break
            append(str(buf[off:off + n], "utf-8"))
            off += n
        else:
            return out, off
    except struct.error:
        pass
    raise GGUFFormatError(f"a string array of {count} entries runs past the file's end "
                          f"(entry {len(out)}, offset {off})")


def _value(buf: memoryview, vtype: int, off: int) -> tuple[Any, int]:
    if vtype == _STRING:
        return _string(buf, off)
    fmt = _SCALARS.get(vtype)
    if fmt is None:
        raise GGUFFormatError(f"unknown value type {vtype} at offset {off}")
    return struct.unpack_from(fmt, buf, off)[0], off + struct.calcsize(fmt)


def _array_values(buf: memoryview, etype: int, count: int, off: int) -> tuple[list[Any], int]:
    if etype == _STRING:
        return _strings(buf, count, off)
    if etype == _ARRAY:  # NOTE: nested arrays: rare, parsed element by element
        nested: list[Any] = []
        for _ in range(count):
            inner, n = struct.unpack_from("<IQ", buf, off)
            values, off = _array_values(buf, inner, n, off + 12)
            nested.append(values)
        return nested, off
    dtype = _NUMPY.get(etype)
    if dtype is None:
        raise GGUFFormatError(f"unknown array element type {etype} at offset {off}")
    end = off + count * np.dtype(dtype).itemsize
    if end > len(buf):
        raise GGUFFormatError(f"an array of {count} entries at offset {off} runs past the end")
    return np.frombuffer(buf, dtype=dtype, count=count, offset=off).tolist(), end


def _skip_array(buf: memoryview, etype: int, count: int, off: int) -> int:
    if etype == _STRING:
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            off += 8 + unpack(buf, off)[0]
        if off > len(buf):
            raise GGUFFormatError(f"a string array runs past the file's end ({off})")
        return off
    if etype == _ARRAY:
        return _array_values(buf, etype, count, off)[1]
    dtype = _NUMPY.get(etype)
    if dtype is None:
        raise GGUFFormatError(f"unknown array element type {etype} at offset {off}")
    return off + count * np.dtype(dtype).itemsize
