"""`coda serve` starts with the cyclic collector paused and leaves it running (issue 19 item 2).

The pause is a start-up cost only: after a start-up that succeeds what it built is frozen and
the collector runs again; after one that fails (a busy port, an unloadable model) the collector
runs again and nothing is frozen, so a process that called ``serve`` (a test, an embedding
program) keeps its collector.
"""

from __future__ import annotations

import gc
import socket
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from coda.cli import app
from coda.commands.startup import startup_gc as _startup_gc


@pytest.fixture
def collector() -> Iterator[None]:
    gc.enable()
    yield
    gc.unfreeze()  # NOTE: the test process's objects stay collectable after the test
    gc.enable()


@pytest.mark.usefixtures("collector")
def test_a_start_up_that_succeeds_freezes_what_it_built_and_resumes_collection() -> None:
    before = gc.get_freeze_count()
    with _startup_gc():
        assert not gc.isenabled()
        built = [[i] for i in range(1000)]
    assert gc.isenabled()
    assert gc.get_freeze_count() >= before + len(built)


@pytest.mark.usefixtures("collector")
def test_a_start_up_that_fails_resumes_collection_and_freezes_nothing() -> None:
    before = gc.get_freeze_count()
    with pytest.raises(RuntimeError), _startup_gc():
        raise RuntimeError("load failed")
    assert gc.isenabled()
    assert gc.get_freeze_count() == before


@pytest.mark.usefixtures("collector")
def test_serve_on_a_busy_port_exits_2_with_the_collector_running() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = CliRunner().invoke(app, ["serve", "--port", str(port)])
    assert result.exit_code == 2
    assert gc.isenabled()


def test_a_paused_collector_is_left_as_the_caller_had_it() -> None:
    gc.disable()
    try:
        with _startup_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
