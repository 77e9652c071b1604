"""One parse of a GGUF file per test session (CI time, issue 9's oracle unchanged).

``gguf.GGUFReader`` builds every metadata field as numpy views in Python: on SmolLM2's 49k-token
vocabulary that is about 6 s of CPU per parse, and transformers' GGUF loading parses the file
twice (config, then weights) and rebuilds gguf's tensor-name table once per module (~400
times). The reader is read-only (a memmap) and the table a pure function of its arguments, so
sharing them changes no value any oracle reads: :func:`gguf_reader` gives the session's reader
of a file, :func:`parsed_once` makes transformers use it too."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path

import gguf

_READERS: dict[tuple[str, int, int], gguf.GGUFReader] = {}
_NEW_READER = gguf.GGUFReader


def gguf_reader(path: str | os.PathLike[str]) -> gguf.GGUFReader:
    """``gguf.GGUFReader(path)``, parsed once per session (keyed by the file's path, size and
    mtime, so a file rewritten in place is parsed afresh)."""
    real = Path(path).resolve()
    st = real.stat()
    key = (str(real), st.st_size, st.st_mtime_ns)
    if key not in _READERS:
        _READERS[key] = _NEW_READER(str(real))
    return _READERS[key]


def _reader(path: str | os.PathLike[str], mode: str = "r") -> gguf.GGUFReader:
    # NOTE: only read-only readers are shared; "r+"/"c" modes get their own, as before
    return gguf_reader(path) if mode == "r" else _NEW_READER(path, mode)  # type: ignore[arg-type]


@contextlib.contextmanager
def parsed_once() -> Iterator[None]:
    """Inside the block ``gguf.GGUFReader`` is :func:`gguf_reader` and
    ``gguf.get_tensor_name_map`` is memoised (transformers imports both from ``gguf`` at each
    call, so the module attributes are what it sees)."""
    names = gguf.get_tensor_name_map
    with contextlib.ExitStack() as stack:
        stack.callback(setattr, gguf, "GGUFReader", gguf.GGUFReader)
        stack.callback(setattr, gguf, "get_tensor_name_map", names)
        gguf.GGUFReader = _reader  # type: ignore[misc,assignment]
        gguf.get_tensor_name_map = functools.cache(names)
        yield
