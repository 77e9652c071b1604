"""A real ``redis-server`` for tests (issue 12): loopback, a free port, a temporary directory,
AOF with ``appendfsync everysec`` (the declared durability model), stopped after."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            if os.environ.get("CI", "").lower() == "true":
                raise RuntimeError("redis-server is missing: .ci/run installs it")
            pytest.skip("redis-server is not installed (.ci/run installs it)")
        self.dir = tempfile.mkdtemp(prefix="coda-redis-")
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
             "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
             "--protected-mode", "yes", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        self.client = client

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def running_redis() -> Iterator[RedisServer]:
    """Body of a module-scoped ``redis_server`` fixture (each test module declares its own)."""
    server = RedisServer()
    yield server
    server.stop()
