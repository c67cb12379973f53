"""Real servers for integration tests, on 127.0.0.1, started by fixtures and stopped by their PID.

A missing server binary skips its tests on a developer's machine, and fails them where
``KVCODEC_REQUIRE_SERVERS=1`` (CI sets it: .ci/run installs the servers), so CI never counts a
skipped integration test as passing.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

REQUIRE = os.environ.get("KVCODEC_REQUIRE_SERVERS") == "1"


def missing(what: str) -> None:
    """Skip (or, under KVCODEC_REQUIRE_SERVERS=1, fail) a test whose server or package is absent."""
    msg = f"{what} is not installed here: integration test not run (CI installs it: .ci/run)"
    if REQUIRE:
        pytest.fail(msg + "; KVCODEC_REQUIRE_SERVERS=1 makes this a failure")
    pytest.skip(msg)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"server did not listen on 127.0.0.1:{port} within {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@contextmanager
def redis_server(tmp_dir: str) -> Iterator[str]:
    """A throwaway redis-server on 127.0.0.1 (no persistence); yields its URL."""
    exe = shutil.which("redis-server")
    if exe is None:
        missing("redis-server (Debian package redis-server)")
    port = free_port()
    proc = subprocess.Popen(
        [exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", tmp_dir, "--protected-mode", "yes", "--loglevel", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port, proc)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop(proc)


def mooncake_master_binary() -> str | None:
    """The ``mooncake_master`` that Mooncake's wheel ships inside its package, or on PATH."""
    try:
        import mooncake
    except ImportError:
        return None
    exe = os.path.join(os.path.dirname(mooncake.__file__ or ""), "mooncake_master")
    if os.path.isfile(exe) and os.access(exe, os.X_OK):
        return exe
    return shutil.which("mooncake_master")


@contextmanager
def mooncake_master(tmp_dir: str, lease_ms: int = 1000) -> Iterator[str]:
    """A throwaway mooncake_master on 127.0.0.1 (its glog files in ``tmp_dir``); yields its URL
    ``mooncake://127.0.0.1:PORT``. Clients must be closed before it stops."""
    exe = mooncake_master_binary()
    if exe is None:
        missing("mooncake_master (pip install 'kvcodec[mooncake]' and Debian libibverbs1 librdmacm1 libnuma1)")
    port, metrics_port = free_port(), free_port()
    with open(os.path.join(tmp_dir, "stdio.log"), "wb") as log:
        proc = subprocess.Popen(
            [exe, "--rpc_address=127.0.0.1", f"--rpc_port={port}", "--rpc_thread_num=2",
             "--metrics_host=127.0.0.1", f"--metrics_port={metrics_port}", "--enable_metric_reporting=false",
             f"--default_kv_lease_ttl={lease_ms}", f"--log_dir={tmp_dir}"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_port(port, proc)
        yield f"mooncake://127.0.0.1:{port}"
    finally:
        stop(proc)
