"""Optional features fail before any work, naming the extra (issue 13 item 5)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from coda import optional
from coda.bench import BenchOptions, run_bench


def test_missing_optional_dependency_is_named_before_work(monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    """--plot without matplotlib: MissingDependency naming the extra, raised before the engine
    is even built (the benchmark never runs)."""
    real = optional.importlib.util.find_spec
    monkeypatch.setattr(optional.importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    built: list[int] = []
    import coda.bench as bench

    monkeypatch.setattr(bench.AsyncEngine, "from_model_dir",
                        classmethod(lambda cls, *a, **k: built.append(1)))
    t0 = time.monotonic()
    with pytest.raises(optional.MissingDependency, match=r"coda-llm\[plot\]"):
        run_bench(BenchOptions(plot=tmp_path / "p.png", num_requests=1))
    assert not built and time.monotonic() - t0 < 5


def test_every_feature_names_an_extra_declared_in_pyproject() -> None:
    import tomllib

    extras = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    for f in optional.FEATURES.values():
        assert f.extra in extras
        declared = " ".join(extras[f.extra])
        # NOTE: a submodule (ray.serve) is its package's: ray[serve] declares it
        assert all(m.partition(".")[0] in declared for m in f.modules), (f, declared)
    for name in optional.FEATURES:  # NOTE: all installed in the test environment
        assert optional.missing(name) == [], name
