"""Give back the mapped file pages of tensors that were copied at load (issue 18: memory).

A GGUF is memory-mapped read-only (coda.models.gguf_header). Most matrices run on their mapped
bytes in place, but the Q4_0/Q4_1/Q8_0 projections are re-laid-out once into the kernel's tile
layout (csrc/blocks.h). Reading them for that copy faults every page of those tensors into the
process, and the pages stay counted in its resident set for as long as the file stays mapped —
which is for the process's life, since the in-place tensors (and a tied head's embedding rows)
are read from the same map. A model whose biggest tensor is re-laid-out then holds it twice
(Gemma 3 270M Q4_K_M: its 178 MB Q8_0 embedding-and-head, RSS 1.65x llama.cpp's).

:func:`release_pages` tells the kernel the process no longer needs those pages
(``madvise(MADV_DONTNEED)``). For a read-only shared file mapping that only drops the page
table entries: the bytes stay in the file (and the page cache), a later read faults them back
in unchanged, so nothing that still reads the tensor in place (an embedding gather) can see
different bytes; only the pages it touches count again. Pages that the range shares with a
neighbouring tensor at either end are kept (the range is shrunk to whole pages inside it).
Where ``madvise`` is not available (not a POSIX libc), nothing is released.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from functools import cache

import numpy as np

# NOTE: Linux's and the BSDs'/macOS's value of MADV_DONTNEED is 4; Python's mmap module names it
MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)


@cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if os.name != "posix":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def whole_pages(address: int, nbytes: int, page: int = mmap.PAGESIZE) -> tuple[int, int]:
    """The largest page-aligned range ``(start, length)`` inside ``[address, address +
    nbytes)``; length 0 when it holds no whole page."""
    start = -(-address // page) * page
    end = (address + nbytes) // page * page
    return start, max(0, end - start)


def _mapped(data: np.ndarray) -> bool:
    """Whether ``data`` is (a view of) a memory map."""
    base: object = data
    while base is not None:
        if isinstance(base, (np.memmap, mmap.mmap)):
            return True
        base = getattr(base, "base", None)
    return False


def release_pages(data: np.ndarray) -> int:
    """Drop the resident pages wholly inside ``data``'s bytes from this process (they are
    read back from the file if anything reads them again); returns the bytes released.
    Anything but a read-only, contiguous view of a memory map is left alone (0): an array
    the process owns or may have written would lose its contents."""
    if not _mapped(data) or data.flags.writeable or not data.flags.c_contiguous:
        return 0
    fn = _madvise()
    start, length = whole_pages(data.ctypes.data, data.nbytes)
    if fn is None or length == 0:
        return 0
    if fn(start, length, MADV_DONTNEED) != 0:
        return 0  # NOTE: only a hint: the pages simply stay resident
    return length
