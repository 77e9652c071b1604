"""The fault matrix of issue 12: run the fault-injection tests and print, per fault, the
streams it hit, their events, and how many were lost or duplicated (both must be 0) and how
many streams lacked exactly one terminal (must be 0).

    python scripts/fault_matrix.py            # runs the tests (Ray + redis-server, ~6 min on 2 cores)
    python scripts/fault_matrix.py --json F   # also writes the rows to F
    python scripts/fault_matrix.py --streams 1000 --load-only   # faults under load, full size

``--streams N`` sizes the faults-under-load test (``tests/test_scaleout_faults.py``: N
concurrent streams, a replica and a front end SIGKILLed, 30% of clients leaving; CI runs 120)
and runs it ``--repeats`` times (default 3 with ``--streams``: the RSS growth from repeat 2 to 3
is checked); its per-repeat summary (orphans, retries, how each kind of client ended, RSS) is
printed after the table.

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
    "tests/test_scaleout_faults.py",
]
COLUMNS = ("fault", "streams", "events", "lost", "duplicated", "bad_terminals")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the rows here too")
    ap.add_argument("--streams", type=int, help="streams of the faults-under-load test "
                    "(default: its CI size, 120)")
    ap.add_argument("--repeats", type=int, help="its repeats (default 3 with --streams, else 1)")
    ap.add_argument("--load-only", action="store_true", help="run only that test")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "faults.jsonl"
        env = {**os.environ, "CODA_FAULT_REPORT": str(report),
               "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        if args.streams:
            env["CODA_FAULT_STREAMS"] = str(args.streams)
            env["CODA_FAULT_REPEATS"] = str(args.repeats or 3)
        elif args.repeats:
            env["CODA_FAULT_REPEATS"] = str(args.repeats)
        tests = [TESTS[-1]] if args.load_only else TESTS
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "-W", "ignore", *tests], cwd=ROOT, env=env)
        lines = [json.loads(line) for line in report.read_text().splitlines()] \
            if report.exists() else []
    rows = [r for r in lines if "fault" in r]
    loads = [r["load"] for r in lines if "load" in r]
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
    for k, load in enumerate(loads, 1):
        print(f"faults under load, repeat {k}: {json.dumps(load)}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "load": loads}, indent=1))
    ok = proc.returncode == 0 and totals["lost"] == totals["duplicated"] == 0
    return 0 if ok and totals["bad_terminals"] == 0 and rows else 1


if __name__ == "__main__":
    sys.exit(main())
