"""The fault matrix of issue 12: run the fault-injection tests and print, per fault, the
streams it hit, their events, and how many were lost or duplicated (both must be 0) and how
many streams lacked exactly one terminal (must be 0).

    python scripts/fault_matrix.py            # runs the tests (Ray + redis-server, ~6 min on 2 cores)
    python scripts/fault_matrix.py --json F   # also writes the rows to F

Each test counts against the durable log (or, without Redis, the ingress's stream) through
``tests/scaleout_support.FaultRow``, asserts the counts are zero, and appends its row to
``$CODA_FAULT_REPORT``; this script only runs them and tabulates. A failing test still writes
its row first, so a non-zero count shows up here as well as in the test's exit status.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = [
    "tests/test_scaleout.py::test_replica_killed_mid_stream_and_before_first_frame_l2_l5_l6",
    "tests/test_scaleout.py::test_100_streams_30pct_disconnects_nothing_lost_or_leaked_p1_p2_p4_l7",
    "tests/test_scaleout_durable.py",
    "tests/test_scaleout_restart.py",
    "tests/test_server_durable.py",
]
COLUMNS = ("fault", "streams", "events", "lost", "duplicated", "bad_terminals")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the rows here too")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "faults.jsonl"
        env = {**os.environ, "CODA_FAULT_REPORT": str(report),
               "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "-W", "ignore", *TESTS], cwd=ROOT, env=env)
        rows = [json.loads(line) for line in report.read_text().splitlines()] \
            if report.exists() else []
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in COLUMNS] if rows \
        else [len(c) for c in COLUMNS]
    print(" | ".join(c.ljust(w) for c, w in zip(COLUMNS, widths, strict=True)))
    print("-|-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(str(r[c]).ljust(w) for c, w in zip(COLUMNS, widths, strict=True)))
    totals = {c: sum(r[c] for r in rows) for c in COLUMNS[1:]}
    print(f"faults injected: {len(rows)}; streams affected: {totals['streams']}; events: "
          f"{totals['events']}; lost: {totals['lost']}; duplicated: {totals['duplicated']}; "
          f"streams without exactly one terminal: {totals['bad_terminals']}; "
          f"tests: {'passed' if proc.returncode == 0 else 'FAILED'}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    ok = proc.returncode == 0 and totals["lost"] == totals["duplicated"] == 0
    return 0 if ok and totals["bad_terminals"] == 0 and rows else 1


if __name__ == "__main__":
    sys.exit(main())
