"""Native kernels of Coda's model layer, compiled on first use (issue 10).

``load()`` JIT-compiles ``ggml_blocks.cpp`` with ``torch.utils.cpp_extension`` (cached in the
torch extensions directory, so only the first process pays the ~1 min build) and returns the
module. It raises :class:`KernelUnavailable`, never crashes, where the CPU lacks AVX2/FMA/F16C
or the compiler is missing; callers log it and fall back to another mode.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from types import ModuleType

_SOURCE = Path(__file__).with_name("ggml_blocks.cpp")
_NEEDED_FLAGS = ("avx2", "fma", "f16c")


class KernelUnavailable(RuntimeError):
    """The native kernel cannot run here (CPU features, compiler); the message says why."""


def cpu_flags() -> set[str]:
    """The CPU feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@functools.cache
def load() -> ModuleType:
    """The compiled ``ggml_blocks`` module; :class:`KernelUnavailable` if it cannot be had."""
    missing = [f for f in _NEEDED_FLAGS if f not in cpu_flags()]
    if missing:
        raise KernelUnavailable(f"CPU lacks {', '.join(missing)} (the GGUF block kernel needs "
                                "AVX2, FMA and F16C)")
    try:
        from torch.utils import cpp_extension

        # NOTE: the name carries the source's hash: worktrees or versions never share a build.
        digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:10]
        module: ModuleType = cpp_extension.load(
            name=f"coda_ggml_blocks_{digest}", sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c"],
            verbose=os.environ.get("CODA_KERNEL_VERBOSE") == "1")
    except (OSError, RuntimeError, ImportError, FileNotFoundError) as exc:
        raise KernelUnavailable(f"could not build {_SOURCE.name}: {exc}") from exc
    return module
