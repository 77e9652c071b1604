"""Native kernels of Coda's model layer, compiled on first use (issue 10).

``load(name)`` JIT-compiles ``<name>.cpp`` (``ggml_blocks``: the GGUF block matmuls;
``row_ops``: fused RoPE + cache write + row-by-row attention) with
``torch.utils.cpp_extension`` (cached in the torch extensions directory, so only the first
process pays the ~1 min build) and returns the module. It raises :class:`KernelUnavailable`, never crashes, where the CPU lacks AVX2/FMA/F16C
or the compiler is missing; callers log it and fall back to another mode.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from types import ModuleType

_HERE = Path(__file__).parent
_NEEDED_FLAGS = ("avx2", "fma", "f16c")
# NOTE: -ffp-contract=off: a written a * b + c stays two roundings (only explicit FMA intrinsics
# fuse), so row_ops' scalar RoPE gives the same bits as torch's elementwise ops.
_EXTRA_FLAGS: dict[str, tuple[str, ...]] = {"row_ops": ("-ffp-contract=off",)}


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
def load(name: str = "ggml_blocks") -> ModuleType:
    """The compiled ``name`` module; :class:`KernelUnavailable` if it cannot be had."""
    source = _HERE / f"{name}.cpp"
    if not source.is_file():
        raise ValueError(f"no native kernel named {name!r}")
    missing = [f for f in _NEEDED_FLAGS if f not in cpu_flags()]
    if missing:
        raise KernelUnavailable(f"CPU lacks {', '.join(missing)} (Coda's native kernels need "
                                "AVX2, FMA and F16C)")
    try:
        from torch.utils import cpp_extension

        # NOTE: the name carries the source's hash: worktrees or versions never share a build.
        digest = hashlib.sha256(source.read_bytes()).hexdigest()[:10]
        module: ModuleType = cpp_extension.load(
            name=f"coda_{name}_{digest}", sources=[str(source)],
            # NOTE: -fopenmp: without it at::parallel_for's OpenMP pragma is ignored and every
            # kernel runs on one thread whatever torch.set_num_threads says.
            extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp",
                          *_EXTRA_FLAGS.get(name, ())],
            extra_ldflags=["-fopenmp"],
            verbose=os.environ.get("CODA_KERNEL_VERBOSE") == "1")
    except (OSError, RuntimeError, ImportError, FileNotFoundError) as exc:
        raise KernelUnavailable(f"could not build {source.name}: {exc}") from exc
    return module
