"""Shared test settings: a bounded Hypothesis profile (noisy 2-core CI machines)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "coda",
    deadline=None,
    max_examples=int(os.environ.get("CODA_HYPOTHESIS_EXAMPLES", "100")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("coda")
