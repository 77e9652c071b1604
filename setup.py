"""Builds ``coda._native``, Coda's CPU kernels, at install (issue 18): ``pip install -e .`` or a
wheel build compiles them once; ``coda serve`` never compiles.

A plain C++ extension (pybind11; no torch header, no libtorch link, so one build serves any
installed torch). ``coda/models/kernels/csrc/isa_*.cpp`` are the same kernel code built for three
instruction sets (portable, AVX2, AVX-512), each file with its own target flags; the module
picks one at run time (``coda/models/kernels/csrc/api.cpp``). Everything else is in
pyproject.toml.
"""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

CSRC = Path("coda/models/kernels/csrc")
X86 = platform.machine().lower() in ("x86_64", "amd64")
# NOTE: per-file ISA flags: only these translation units may hold AVX2/AVX-512 code, which runs
# only after the CPU check (isa.h explains why each lives in its own namespace).
ISA_FLAGS = {
    "isa_avx2.cpp": ["-mavx2", "-mfma", "-mf16c"],
    # NOTE: GCC 12 warns of the undefined upper half that a 256 -> 512-bit cast leaves (unused)
    "isa_avx512.cpp": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512dq",
                       "-mavx512vl", "-mavx512vnni", "-Wno-maybe-uninitialized",
                       "-Wno-uninitialized"],
}
SOURCES = ["module.cpp", "api.cpp", "pool.cpp", "isa_scalar.cpp",
           *(["isa_avx2.cpp", "isa_avx512.cpp"] if X86 else [])]


def source_hash() -> str:
    """sha256 (12 hex) of every C++ file: the built module carries it, so a stale build (sources
    changed, module not rebuilt) is reported instead of silently run."""
    h = hashlib.sha256()
    for path in sorted(CSRC.glob("*.[ch]*")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


class BuildExt(build_ext):  # type: ignore[misc]
    """build_ext with :data:`ISA_FLAGS` added to the compile of the named files only."""

    def build_extensions(self) -> None:
        compile_one = self.compiler._compile

        def _compile(obj, src, ext, cc_args, extra_postargs, pp_opts):  # type: ignore[no-untyped-def]
            extra = ISA_FLAGS.get(Path(src).name, [])
            return compile_one(obj, src, ext, cc_args, [*extra_postargs, *extra], pp_opts)

        self.compiler._compile = _compile
        super().build_extensions()


native = Pybind11Extension(
    "coda._native",
    sources=[str(CSRC / s) for s in SOURCES],
    include_dirs=[str(CSRC)],
    depends=[str(p) for p in sorted(CSRC.glob("*.h"))],  # NOTE: a header edit rebuilds
    cxx_std=17,
    # NOTE: -ffp-contract=off: a written a * b + c stays two roundings in every build (only the
    # explicit fma of isa.h fuses), which the canonical order across ISAs depends on.
    extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", "-pthread"],
    extra_link_args=["-pthread"],
    define_macros=[("CODA_NATIVE_SOURCE_HASH", f'"{source_hash()}"')],
    # NOTE: optional: installed where it cannot compile, Coda still installs and serves on the
    # torch path, and the load summary says the kernels are missing and why (CI sets
    # CODA_REQUIRE_NATIVE=1, so a failed build fails the tests there).
    optional=True,
)

setup(ext_modules=[native], cmdclass={"build_ext": BuildExt})
