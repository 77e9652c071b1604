"""Every test file that starts Ray shares the one xdist unit ``ray`` (tests/conftest.py's
``RAY_FILES``): a Ray file left out runs on another worker, whose session fixture starts a
second Ray cluster beside the first on a 2-core machine (the scale-out tests' timeouts)."""
from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import RAY_FILES

_USES_RAY = re.compile(r'importorskip\("ray"\)|^import ray\b|^\s*replicas: Any', re.M)


def test_every_file_that_starts_ray_is_in_the_ray_group() -> None:
    here = Path(__file__).parent
    uses = {p.name for p in here.glob("test_*.py") if _USES_RAY.search(p.read_text())}
    assert uses, "the pattern finds no Ray test file: it is out of date"
    assert uses - RAY_FILES == set(), "add these to RAY_FILES in tests/conftest.py"
    assert RAY_FILES - uses == set(), "these RAY_FILES no longer start Ray"
