"""Run the trace checker's corruption corpus (issue 20 deliverable 3) and print its figures.

    python scripts/trace_corpus.py                 # the CI sample: 12 per class
    python scripts/trace_corpus.py --per-class 0   # every corruption of the fixture
    python scripts/trace_corpus.py --trace F.jsonl # another real trace (scripts/trace_faultmix.py)

Prints corruptions generated, killed (rejected), allowed as equivalent (by allow-list entry),
the kill rate over the non-equivalent ones, which rule killed first how often, and every
survivor or false alarm. Exit status 1 unless the kill rate is 100% with no false alarm.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    from tests.trace_corpus import FAULTMIX, load, run_corpus

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=FAULTMIX)
    ap.add_argument("--per-class", type=int, default=12, help="sites per class (0: all)")
    args = ap.parse_args()
    traces = load(args.trace)
    t0 = time.perf_counter()
    rep = run_corpus(traces, per_class=args.per_class)
    took = time.perf_counter() - t0
    print(f"trace: {args.trace.name}: {sum(map(len, traces.values()))} rows, "
          f"{len(traces)} requests")
    print(f"classes: {rep.classes}; corruptions generated: {rep.generated}; killed: "
          f"{rep.killed}; allowed as equivalent: {rep.allowed}; survivors: "
          f"{len(rep.survivors)}; false alarms: {len(rep.false_alarms)}; kill rate: "
          f"{100 * rep.kill_rate:.2f}% ({took:.1f} s)")
    print("allowed:", dict(sorted(rep.by_allow.items())))
    print("killed first by:", dict(sorted(rep.by_rule.items(), key=lambda kv: -kv[1])))
    for s in rep.survivors:
        print("SURVIVOR", s)
    for s in rep.false_alarms:
        print("FALSE ALARM", s)
    return 0 if not rep.survivors and not rep.false_alarms else 1


if __name__ == "__main__":
    sys.exit(main())
