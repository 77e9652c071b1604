"""``coda serve``'s start-up costs (issue 19 item 2): torch's libraries loaded on the second
core while the server is imported, and the cyclic collector paused while start-up allocates."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path


def preload_torch_libraries() -> None:
    """Load torch's shared libraries (``libtorch_python`` and what it links: libtorch_cpu,
    c10, gomp) in a background thread, so that the later ``import torch`` finds them loaded.

    Issue 19 item 2: mapping and relocating them is a fifth of ``import torch`` (~0.3 s of CPU),
    and ``ctypes`` releases the GIL for it, so it runs on the second core while this thread
    imports the server (FastAPI, pydantic: ~0.7 s). Loaded ``RTLD_LOCAL`` as torch loads them
    itself; ``import torch`` waits on the loader's lock if it comes first, so nothing else
    changes. Where the file is not found (another layout or platform) nothing is done."""
    import ctypes
    import importlib.util
    import threading

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib" / "libtorch_python.so"
    if not lib.is_file():
        return

    def load() -> None:
        # NOTE: a failure is import torch's to report, as it always was; ctypes never unloads
        # a library, so the handle may be dropped
        with contextlib.suppress(OSError):
            ctypes.CDLL(str(lib))

    threading.Thread(target=load, name="coda-torch-libs", daemon=True).start()


@contextlib.contextmanager
def startup_gc() -> Iterator[None]:
    """Start-up with Python's cyclic collector paused (issue 19 item 2).

    Importing torch and FastAPI and building the model allocate some 350k objects, and the
    collector scanned them again and again (five full collections): 0.35-0.5 s of a 2.4 s
    start. Nothing of the start-up needs it (its cyclic garbage is ~7k small objects: typing's
    tuples, cells and functions). On success what start-up built is frozen (the permanent
    generation: never scanned again, as CPython's ``gc.freeze`` is meant for long-lived
    start-up state), then the collector runs as before for everything made later; on failure
    it is only resumed."""
    import gc

    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    except BaseException:
        gc.enable()
        raise
    gc.freeze()
    gc.enable()
