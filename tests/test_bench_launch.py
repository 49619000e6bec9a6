"""LaunchedServer (ferry/bench/launch.py): the server's log is removed after a clean run, kept after a failure."""

from __future__ import annotations

import os
import sys

import pytest

from ferry.bench.launch import LaunchedServer
from ferry.utils.network import free_port

# Python's http.server as the server, with Python's own Ctrl-C handler: a process started in the
# background by a shell inherits SIGINT ignored, and a Python started so leaves it ignored (the
# servers ferry launches, uvicorn and llama-server, install their own handlers).
SERVE_WITH_CTRL_C = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                     "sys.argv[0] = 'http.server'; runpy.run_module('http.server', run_name='__main__')")  # fmt: skip


def http_server(tmp_path) -> LaunchedServer:
    port = free_port()
    cmd = [sys.executable, "-c", SERVE_WITH_CTRL_C, "--bind", "127.0.0.1", "--directory", str(tmp_path), str(port)]
    return LaunchedServer(cmd, port, "/", 60)


def test_the_log_of_a_clean_run_is_removed(tmp_path):
    server = http_server(tmp_path)
    with server:
        assert os.path.exists(server.log.name)
    assert server.proc.returncode in (0, -2)
    assert not os.path.exists(server.log.name)


def test_the_log_is_kept_and_named_when_the_run_failed(tmp_path, capsys):
    server = http_server(tmp_path)
    with pytest.raises(ValueError), server:
        raise ValueError("the benchmark failed")
    assert os.path.exists(server.log.name)
    assert f"log kept: {server.log.name}" in capsys.readouterr().err
    os.unlink(server.log.name)

    died = http_server(tmp_path)
    with died:
        died.proc.kill()  # the server crashed under the benchmark
        died.proc.wait(30)
    assert os.path.exists(died.log.name)
    os.unlink(died.log.name)
