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
checkpoint costs one sequential read (about a second per GB), once; a GGUF load hashes beside
its other steps and remembers the digest of a file that has not changed since
(:func:`digest_files_soon`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from coda.models.background import soon
from coda.models.gguf_parts import cache_root

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


# NOTE: a file changed this recently is never remembered (its next change could keep the
# timestamps: they tick coarser than nanoseconds); as git's "racy" index entries
_SETTLED_S = 2.0


def _remembered(paths: Sequence[Path]) -> tuple[Path, bool]:
    """Where :func:`digest_files_soon` keeps the digest of these files as they are now, and
    whether every file is old enough for it to be kept. The key is each file's path, device,
    inode, size, mtime and ctime (ctime cannot be set back: a file rewritten in place and its
    mtime restored still gets a new key)."""
    key, settled = [], True
    for path in paths:
        st = os.stat(path)
        key.append([str(Path(path).resolve()), st.st_dev, st.st_ino, st.st_size,
                    st.st_mtime_ns, st.st_ctime_ns])
        settled &= time.time() - max(st.st_mtime, st.st_ctime) > _SETTLED_S
    name = hashlib.sha256(json.dumps(["digest_files-v1", key]).encode()).hexdigest()
    return cache_root() / "digests" / name, settled


def digest_files_soon(paths: Sequence[Path]) -> Callable[[], str]:
    """:func:`digest_files` of files unchanged since a load hashed them read back from the
    cache (``$CODA_CACHE_DIR/digests``: a warm start of a 1 GB model skips a second of
    hashing), else started now in a background thread (file reads and hashlib's updates release
    the GIL, so it runs beside the load's other steps: the weights' re-layout, the tokenizer)
    and remembered; the returned function waits for the digest (raising what it raised)."""
    entry: Path | None = None
    try:
        entry, settled = _remembered(paths)
        known = entry.read_text(encoding="ascii").strip()
        if len(known) == 64 and all(c in "0123456789abcdef" for c in known):
            return lambda: known
    except (OSError, UnicodeDecodeError):  # NOTE: no entry yet, no cache, a missing file (the
        pass  # hash raises it), or a damaged entry: hashed again and rewritten, never a failed load

    def run() -> str:
        digest = digest_files(paths)
        if entry is not None and settled:
            _remember(entry, digest)
        return digest

    return soon(run, "coda-digest")


def _remember(entry: Path, digest: str) -> None:
    """Write ``entry`` whole or not at all (a temporary name, then a rename); a cache that
    cannot be written is only a slower next start."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
        tmp.write_text(digest, encoding="ascii")
        os.replace(tmp, entry)
    except OSError:
        pass


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
    rope: str | None = None  # a RoPE choice made at load (LongRoPE's long factors), else None

    @property
    def snapshot(self) -> str:
        """``sha256:<hex>`` over the canonical JSON of every part: equal iff all parts are."""
        parts = asdict(self)
        if parts["rope"] is None:
            del parts["rope"]  # NOTE: so every snapshot taken before this part existed stays
        canon = json.dumps(parts, sort_keys=True, separators=(",", ":"))
        return "sha256:" + hashlib.sha256(canon.encode()).hexdigest()

    def to_dict(self) -> dict[str, str | None]:
        return {"model_snapshot": self.snapshot, **asdict(self)}


def model_identity(*, weights_sha256: str, tokenizer: str | bytes, chat_template: str | None,
                   dtype: str, quantization: str | None = None, quant_mode: str | None = None,
                   version: str | None = None, kernel_order: str | None = None,
                   rope: str | None = None) -> ModelIdentity:
    """The one computation of a model's identity (see the module docstring).

    ``weights_sha256``: :func:`digest_files` of the weight files (or :func:`digest_chunks` of
    the tensors); ``tokenizer``: the serialized tokenizer (``tokenizer.json`` text, or the
    GGUF's tokenizer fields serialized canonically); ``chat_template``: the template source, or
    None; ``dtype``: the serving (activation) dtype; ``quantization``: e.g. ``"Q4_1"``, None if
    unquantized; ``quant_mode``: how the weights are served (``"q4"`` keeps them packed,
    ``"fp32"`` dequantizes them): a different mode is a different snapshot; ``kernel_order``:
    the summation order its kernels keep (:meth:`coda.models.modes.QuantMode.kernel_order`);
    ``rope``: a RoPE choice made at load that changes the numbers
    (:meth:`coda.models.config.ModelConfig.rope_choice`), None for the file's own.
    """
    return ModelIdentity(weights_sha256=weights_sha256, tokenizer_sha256=_sha(tokenizer) or "",
                         chat_template_sha256=_sha(chat_template), dtype=dtype,
                         quantization=quantization, coda_version=version or coda_version(),
                         quant_mode=quant_mode, kernel_order=kernel_order, rope=rope)
