"""Work started now and collected later, beside a load's other steps (issue 19 item 2).

A GGUF load hashes its file and lays out its weights while the tokenizer is built: file reads,
hashlib and NumPy's copies release the GIL, so on a machine with a free core the steps overlap,
and on a busy one the load's threads get more of the CPU than one thread would.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def soon(work: Callable[[], T], name: str) -> Callable[[], T]:
    """Start ``work()`` in a daemon thread named ``name``; the returned function waits for it
    and returns its result or raises its exception (in the caller's thread). A caller that
    fails meanwhile and never asks does not wait for it (a daemon: the process exits)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = work()
        except BaseException as exc:  # NOTE: handed to the caller, raised there
            box["error"] = exc

    worker = threading.Thread(target=run, name=name, daemon=True)
    worker.start()

    def result() -> T:
        worker.join()
        if "error" in box:
            raise box["error"]
        out: T = box["result"]
        return out

    return result
