"""The content identity of what produces a model's output: ``model_snapshot`` (SPEC P1, P3;
seed 000 §4.7; issue 8).

Two outputs can be compared knowing they came from the same thing only if the snapshot names
the *content*, not a folder: the weights' bytes, the tokenizer, the chat template, the serving
dtype, quantization and serving mode (``--quant``), the Coda version (whose rules decide the
bytes and the endings) and the kernels' summation order (``kernel_order``: Coda's native
kernels' one canonical order, the same on every machine and ISA, e.g. ``lanes16-v2``; or, for a
mode whose matmuls run on torch, the torch version and CPU capability, since BLAS picks its
order from the machine: a replica whose kernels sum in another order is another snapshot, so a
request is never resumed on a replica that would continue it with other bits; issue 18).

:func:`model_identity` is the one place the identity is computed; every loader calls it once at
load with its own inputs (the safetensors loader with its ``*.safetensors`` files via
:func:`digest_files`; a GGUF loader with its ``.gguf`` file and its quantization name). Pure
Python (``hashlib``), no torch: hashing streams the files in 16 MiB blocks, so a multi-GB
checkpoint costs one sequential read (about a second per GB), once.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

# NOTE: 16 MiB: the read and the hash release the GIL, and each block takes it back twice; with
# small blocks a digest beside the load (digest_files_soon) stalls the load's thread
_BLOCK = 16 << 20


def coda_version() -> str:
    try:
        return metadata.version("coda-llm")
    except metadata.PackageNotFoundError:  # NOTE: a source tree that was never installed
        return "0+unknown"


def digest_files(paths: Sequence[Path]) -> str:
    """sha256 over the files' bytes in the given order, each framed by its length, so that
    moving bytes from one shard to the next changes the digest. Streams; never loads a file."""
    h = hashlib.sha256()
    block = memoryview(bytearray(_BLOCK))
    for path in paths:
        h.update(path.stat().st_size.to_bytes(8, "big"))
        with open(path, "rb", buffering=0) as fh:
            while n := fh.readinto(block):
                h.update(block[:n])
    return h.hexdigest()


def digest_files_soon(paths: Sequence[Path]) -> Callable[[], str]:
    """:func:`digest_files` started now in a background thread (file reads and hashlib's
    updates release the GIL, so it runs beside the load's other steps: the weights' re-layout,
    the tokenizer); the returned function waits for the digest (raising what it raised)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["digest"] = digest_files(paths)
        except BaseException as exc:  # NOTE: handed to the caller, raised there
            box["error"] = exc

    # NOTE: a daemon: a load that fails meanwhile exits without waiting for the hash
    worker = threading.Thread(target=run, name="coda-digest", daemon=True)
    worker.start()

    def result() -> str:
        worker.join()
        if "error" in box:
            raise box["error"]
        return str(box["digest"])

    return result


def digest_chunks(chunks: Iterable[bytes]) -> str:
    """sha256 of byte chunks, each framed by its length (e.g. tensor bytes in name order)."""
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(len(chunk).to_bytes(8, "big"))
        h.update(chunk)
    return h.hexdigest()


def _sha(text: str | bytes | None) -> str | None:
    if text is None:
        return None
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


@dataclass(frozen=True)
class ModelIdentity:
    """The identity's parts (hex sha256 digests) and the snapshot id derived from them."""

    weights_sha256: str
    tokenizer_sha256: str
    chat_template_sha256: str | None
    dtype: str
    quantization: str | None
    coda_version: str
    quant_mode: str | None = None  # the serving mode (coda/models/modes.py): fp32, q4 …
    kernel_order: str | None = None  # the matmuls' summation order (QuantMode.kernel_order)

    @property
    def snapshot(self) -> str:
        """``sha256:<hex>`` over the canonical JSON of every part: equal iff all parts are."""
        canon = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return "sha256:" + hashlib.sha256(canon.encode()).hexdigest()

    def to_dict(self) -> dict[str, str | None]:
        return {"model_snapshot": self.snapshot, **asdict(self)}


def model_identity(*, weights_sha256: str, tokenizer: str | bytes, chat_template: str | None,
                   dtype: str, quantization: str | None = None, quant_mode: str | None = None,
                   version: str | None = None, kernel_order: str | None = None) -> ModelIdentity:
    """The one computation of a model's identity (see the module docstring).

    ``weights_sha256``: :func:`digest_files` of the weight files (or :func:`digest_chunks` of
    the tensors); ``tokenizer``: the serialized tokenizer (``tokenizer.json`` text, or the
    GGUF's tokenizer fields serialized canonically); ``chat_template``: the template source, or
    None; ``dtype``: the serving (activation) dtype; ``quantization``: e.g. ``"Q4_1"``, None if
    unquantized; ``quant_mode``: how the weights are served (``"q4"`` keeps them packed,
    ``"fp32"`` dequantizes them): a different mode is a different snapshot; ``kernel_order``:
    the summation order its kernels keep (:meth:`coda.models.modes.QuantMode.kernel_order`).
    """
    return ModelIdentity(weights_sha256=weights_sha256, tokenizer_sha256=_sha(tokenizer) or "",
                         chat_template_sha256=_sha(chat_template), dtype=dtype,
                         quantization=quantization, coda_version=version or coda_version(),
                         quant_mode=quant_mode, kernel_order=kernel_order)
