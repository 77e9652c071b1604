"""Optional dependencies, checked before the work that needs them starts (issue 13 item 5).

``coda bench --plot`` once ran the whole benchmark and then died importing matplotlib. Every
optional feature now calls :func:`require` first, so a missing package is reported at once,
naming the extra that installs it. One table, one home: :data:`FEATURES`. Several features
asked for at once (``coda serve --replicas 2 --redis-url ...``) get one message naming every
extra they need (``coda-llm[scale,durable]``, issue 24 item 5).
"""

from __future__ import annotations

import importlib.machinery
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
    # NOTE: ray.serve is found without importing ray (seconds): see _findable
    "replicas": Feature("coda serve --replicas / --ray-address", ("ray", "ray.serve", "msgpack"),
                        "scale"),
    "redis": Feature("coda serve --redis-url", ("redis", "msgpack"), "durable"),
}


class MissingDependency(RuntimeError):
    """An optional feature was asked for without its package (message names the extra)."""


def _findable(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (nor, for a submodule, its
    package: ``ray.serve`` is looked up in ray's folder)."""
    head, _, rest = module.partition(".")
    try:
        spec = importlib.util.find_spec(head)
    except (ImportError, ValueError):  # NOTE: a broken or half-imported package
        return False
    for part in rest.split(".") if rest else ():
        if spec is None or spec.submodule_search_locations is None:
            return False
        spec = importlib.machinery.PathFinder.find_spec(part, spec.submodule_search_locations)
    return spec is not None


def missing(feature: str) -> list[str]:
    """The modules of ``feature`` that cannot be imported here."""
    return [m for m in FEATURES[feature].modules if not _findable(m)]


def require(*features: str) -> None:
    """Raise :class:`MissingDependency` before any work when one of ``features`` cannot run:
    one message for all of them, naming every missing module once and one ``pip install``
    with every extra needed."""
    absent: dict[str, None] = {}
    lacking = []
    for name in features:
        gone = missing(name)
        if gone:
            lacking.append(FEATURES[name])
            absent.update(dict.fromkeys(gone))
    if lacking:
        mods = [m for m in absent if "." not in m or m.partition(".")[0] not in absent]
        extras = ",".join(dict.fromkeys(f.extra for f in lacking))
        raise MissingDependency(
            f"{' and '.join(f.name for f in lacking)} need{'s' if len(lacking) == 1 else ''} "
            f"{', '.join(mods)}, which {'is' if len(mods) == 1 else 'are'} not installed: "
            f"pip install 'coda-llm[{extras}]'")
