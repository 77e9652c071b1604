"""Optional dependencies, checked before the work that needs them starts (issue 13 item 5).

``coda bench --plot`` once ran the whole benchmark and then died importing matplotlib. Every
optional feature now calls :func:`require` first, so a missing package is reported at once,
naming the extra that installs it. One table, one home: :data:`FEATURES`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

__all__ = ["FEATURES", "MissingDependency", "Feature", "require"]


@dataclass(frozen=True)
class Feature:
    """An optional feature: the modules it imports and the pyproject extra providing them."""

    name: str
    modules: tuple[str, ...]
    extra: str


FEATURES: dict[str, Feature] = {
    "plot": Feature("coda bench --plot", ("matplotlib",), "plot"),
    "compare_hf": Feature("coda bench --compare-hf", ("transformers",), "compare"),
}


class MissingDependency(RuntimeError):
    """An optional feature was asked for without its package (message names the extra)."""


def missing(feature: str) -> list[str]:
    """The modules of ``feature`` that cannot be imported here."""
    return [m for m in FEATURES[feature].modules if importlib.util.find_spec(m) is None]


def require(feature: str) -> None:
    """Raise :class:`MissingDependency` before any work when ``feature`` cannot run."""
    absent = missing(feature)
    if absent:
        f = FEATURES[feature]
        raise MissingDependency(
            f"{f.name} needs {', '.join(absent)}, which is not installed: "
            f"pip install 'coda-llm[{f.extra}]' (or pip install {' '.join(absent)})")
