"""``coda models``: what Coda can load here (issue 9 item 1).

Lists the embedded model, every installed Python distribution whose RECORD ships ``.gguf``
files (found through ``importlib.metadata``; nothing is imported), and the folders or files
given on the command line, each with architecture, parameter count, file size, stored
quantization, context length and serving modes (``--quant``: what ``auto`` picks here and why,
every mode that would load, and why each other one would not; issue 19 item 5). Reading a
GGUF's header (``gguf_header``: long arrays such as the vocabulary are not parsed) does not
load its tensors: a row takes well under a second (``read_s`` says how long it took).
"""

from __future__ import annotations

import importlib.metadata as md
import re
import time
from dataclasses import dataclass
from pathlib import Path

from coda.models.config import ModelConfig, ModelLoadError
from coda.models.gguf_file import GGUFCheckpoint, open_gguf
from coda.models.gguf_parts import _PART, cache_dir, find_parts
from coda.models.modes import AUTO_ORDER, FOLDER_AUTO, QUANT_MODES, modes_for
from coda.models.source import ModelSource, package_ggufs, resolve_model


@dataclass(frozen=True)
class ModelEntry:
    """One row of ``coda models``; ``error`` is set (and the figures empty) when unreadable."""

    model: str  # what to pass to --model
    kind: str
    path: Path
    arch: str = ""
    parameters: int = 0
    size_bytes: int = 0
    quantization: str = ""
    context: int = 0
    error: str = ""
    quant_auto: str = ""  # what --quant auto serves it as
    quant_modes: tuple[str, ...] = ()  # every --quant that loads it here
    why: str = ""  # why auto picks quant_auto: the mode's numerics, what it skipped first
    refused: tuple[tuple[str, str], ...] = ()  # (mode, why it would not load here)
    read_s: float = 0.0  # how long reading the row took


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def describe_source(model: str, src: ModelSource) -> ModelEntry:
    """The catalog row of one resolved source."""
    start = time.perf_counter()
    try:
        ckpt = None
        if src.kind == "gguf":
            ckpt = open_gguf(src.path)
            cfg, quant = ckpt.config, ckpt.quantization
        else:
            cfg = ModelConfig.from_dir(src.path)
            quant = cfg.torch_dtype
        auto, names = modes_for(ckpt)
    except (ModelLoadError, OSError, ValueError, KeyError) as exc:
        return ModelEntry(model, src.kind, src.path, error=str(exc))
    why, refused = _reasons(ckpt, auto.name, names)
    return ModelEntry(model, src.kind, src.path, cfg.arch, cfg.num_parameters, _size(src.path),
                      quant, cfg.max_context, quant_auto=auto.name, quant_modes=names, why=why,
                      refused=refused, read_s=time.perf_counter() - start)


def _reasons(ckpt: GGUFCheckpoint | None, auto: str, names: tuple[str, ...]
             ) -> tuple[str, tuple[tuple[str, str], ...]]:
    """(why ``auto`` is ``auto``, each mode that would not load and why) for one model."""
    refused: list[tuple[str, str]] = []
    for name, mode in QUANT_MODES.items():
        if name in names:
            continue
        why = (mode.available() or (mode.applies(ckpt) if ckpt is not None else None)
               or ("needs a GGUF file" if ckpt is None and not mode.dense else "not available"))
        refused.append((name, why))
    order = AUTO_ORDER if ckpt is not None else (FOLDER_AUTO,)
    skipped = [f"{n}: {w}" for n, w in refused if n in order[:order.index(auto)]] \
        if auto in order else [f"{n}: {w}" for n, w in refused if n in order]
    mode = QUANT_MODES[auto]
    invariant = "batch-invariant" if mode.batch_invariant else "NOT batch-invariant (T4)"
    tried = (f"auto takes the first of {', '.join(order)} that loads here" if ckpt is not None
             else f"an HF folder runs {FOLDER_AUTO}, or fp32 where the native kernels are missing")
    first = tried if not skipped else f"{tried}; skipped {'; '.join(skipped)}"
    return f"{auto}: {invariant}; {first}", tuple(refused)


def gguf_packages() -> list[tuple[str, list[Path]]]:
    """``(distribution name, its .gguf files)`` for every installed distribution shipping any,
    and for every umbrella of a GGUF shipped in parts (:mod:`coda.models.gguf_parts`): its
    assembled copy in the cache, or the parts' would-be path there before the first load."""
    found: dict[str, list[Path]] = {}
    part_dists: set[str] = set()
    for dist in md.distributions():
        record = dist.read_text("RECORD")
        # NOTE: a wheel's RECORD without ".gguf" lists neither a GGUF nor a part: skip parsing
        # it into paths (torch's alone is ~10k rows; ~2 s of `coda models` went there)
        if record is not None and ".gguf" not in record:
            continue
        name = dist.metadata["Name"]
        if not name or name in found:
            continue
        files = [str(f) for f in dist.files or ()]
        if any(f.endswith(".gguf") for f in files):
            found[name] = package_ggufs(dist)
        elif any(_PART.search(f) for f in files):
            part_dists.add(md_key(name))
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name and name not in found and md_key(name) not in part_dists and any(
                md_key(r) in part_dists for r in _requirement_names(dist)):
            parts = find_parts(dist)
            if len(parts) == 1:
                found[name] = [cache_dir() / next(iter(parts))]
    return sorted(found.items())


def md_key(name: str) -> str:
    """A distribution name as the index compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names(dist: md.Distribution) -> list[str]:
    return [re.split(r"[\s;<>=!~\[(]", r.strip(), maxsplit=1)[0] for r in dist.requires or ()]


def list_models(extra: list[str]) -> list[ModelEntry]:
    """The embedded model, GGUF packages, then ``extra`` (folders, files, package names): one
    entry each, in order (:func:`named_entries`)."""
    for mode in QUANT_MODES.values():
        mode.available()  # NOTE: the same for every row: the kernels' import, checked once
    entries = [describe_source("(default)", resolve_model(None))]
    for name, files in gguf_packages():
        if len(files) == 1 and not files[0].is_file():  # NOTE: parts, not assembled yet
            entries.append(ModelEntry(name, "gguf", files[0], error=(
                "shipped in parts: assembled into this path on the first load "
                f"(`coda serve --model {name}`), then described here")))
        elif len(files) == 1:
            entries.append(describe_source(name, ModelSource("gguf", files[0], files[0].stem,
                                                             package=name)))
        else:  # NOTE: not loadable by package name; each file still is, by its path
            entries.extend(describe_source(str(f), ModelSource("gguf", f, f.stem, package=name))
                           for f in files)
    for spec in extra:
        try:
            entries.append(describe_source(spec, resolve_model(spec)))
        except ModelLoadError as exc:
            entries.append(ModelEntry(spec, "?", Path(spec), error=str(exc)))
    return entries


def named_entries(entries: list[ModelEntry], named: list[str]) -> list[ModelEntry]:
    """The rows of :func:`list_models` for the models the user named (its last, one each):
    ``coda models PATH`` fails when one of them cannot be read."""
    return entries[len(entries) - len(named):] if named else []
