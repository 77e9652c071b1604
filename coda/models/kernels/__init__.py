"""Coda's native kernels (issues 10, 18): the C++ module ``coda._native``, built at install.

``pip install`` (setup.py) compiles ``csrc/`` once into ``coda._native``: GGUF block matmuls
(``ggml_linear.py``) and the decoder's row ops (RoPE + KV write + paged attention, fused
add + RMSNorm, SiLU-gate; ``ops.py``). Nothing is ever compiled at serve time: where the module
is missing (installed without a compiler, or a source tree never built) or stale (its sources
changed since it was built), :func:`native` raises :class:`KernelUnavailable` with the reason and
callers run the torch path instead, saying so in the load summary (:func:`describe`).

The module holds the kernel code three times (portable, AVX2, AVX-512) and runs the best one the
CPU reports; ``CODA_KERNEL_ISA=scalar|avx2|avx512`` picks one (empty: the best). A name that is
no build, or a build the CPU cannot run, is the user's error, not a reason to fall back:
:class:`KernelIsaError` (a ``ValueError``) naming the builds this CPU runs. All three give the same bits (``csrc/isa.h``'s canonical summation order), so
the choice changes speed, never output. Threads: the module's own pool, sized by
:func:`set_threads` (the runner passes ``--threads``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import os
from pathlib import Path
from types import ModuleType

ISA_ENV = "CODA_KERNEL_ISA"
CSRC = Path(__file__).parent / "csrc"


class KernelUnavailable(RuntimeError):
    """The native kernels cannot run here (module not built or stale); says why. Callers fall
    back to the torch path."""


class KernelIsaError(ValueError):
    """:data:`ISA_ENV` names no build, or one this CPU cannot run; says which it runs. Never a
    fallback: the torch path's mode and output differ from what the user asked for."""


def source_hash(csrc: Path = CSRC) -> str | None:
    """setup.py's hash of the C++ sources (None where they are not shipped, e.g. a wheel)."""
    files = sorted(csrc.glob("*.[ch]*"))
    if not files:
        return None
    h = hashlib.sha256()
    for path in files:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


@functools.cache
def native() -> ModuleType:
    """The built module with :data:`ISA_ENV` applied; :class:`KernelUnavailable` otherwise."""
    try:
        mod = importlib.import_module("coda._native")
    except ImportError as exc:
        raise KernelUnavailable(f"coda._native is not built ({exc}); install the package with a "
                                "C++ compiler present (pip install -e .)") from exc
    want, built = source_hash(), str(mod.source_hash)
    if want is not None and want != built:
        raise KernelUnavailable(f"coda._native is stale (built from sources {built}, the tree "
                                f"has {want}); rebuild it: pip install -e . (or python setup.py "
                                "build_ext --inplace)")
    isa = os.environ.get(ISA_ENV, "").strip()
    if isa:
        try:
            mod.set_isa(isa)
        except ValueError as exc:
            raise KernelIsaError(f"{ISA_ENV}={isa}: {exc}; this CPU runs: "
                                 f"{', '.join(mod.isas())} (empty: the best of them)") from exc
    return mod


def unavailable() -> str | None:
    """Why the native kernels cannot run here (None: they can); a refused :data:`ISA_ENV` is
    raised (:class:`KernelIsaError`), not returned."""
    try:
        native()
    except KernelUnavailable as exc:
        return str(exc)
    return None


def check_isa() -> None:
    """Raise :class:`KernelIsaError` now if :data:`ISA_ENV` is refused (the CLI calls it before
    any work); a missing or stale module is not an error here (the torch path runs)."""
    unavailable()


def set_threads(n: int) -> None:
    """Size the kernels' thread pool (the calling thread plus ``n - 1`` workers); a no-op
    where the module is unavailable."""
    if unavailable() is None:
        native().set_threads(max(1, int(n)))


def order(native_kernels: bool) -> str:
    """The summation order a mode's matmuls keep, for the model identity (P1; issue 18): the
    native module's one canonical order (``csrc/isa.h``; every ISA build keeps it, so it names
    no ISA), or for torch's (BLAS) matmuls the torch version and CPU capability they depend on."""
    if native_kernels:
        return f"coda-native/{native().canonical_order}"
    import torch  # NOTE: only here: this package stays importable without torch

    return f"torch-{torch.__version__}/{torch.backends.cpu.get_cpu_capability()} (per machine)"


def describe() -> dict[str, str]:
    """The kernel state for the load summary: the ISA in use, the summation order every ISA
    shares, the thread count; or why the kernels are missing."""
    why = unavailable()
    if why is not None:
        return {"native_kernels": f"unavailable: {why}; attention and norms run on torch, and "
                                  "a GGUF's `auto` mode is q4 or fp32 instead of packed, an HF "
                                  "folder's fp32 (NOT batch-invariant) instead of fp32-kernel"}
    mod = native()
    return {"native_kernels": f"{mod.isa()} (of {', '.join(mod.isas())}; "
                              f"{mod.threads()} threads)",
            "kernel_order": str(mod.canonical_order)}
