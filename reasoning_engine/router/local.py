"""Local replicas: `reasoning-engine serve` child processes on free ports, started together, stopped together."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class LocalReplica:
    """One `reasoning-engine serve` process; its own process group, so stopping it stops its rank processes too."""

    serve_args: list[str]
    port: int = field(default_factory=free_port)
    host: str = "127.0.0.1"
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, log: int | None = None) -> None:
        command = [sys.executable, "-m", "reasoning_engine.cli", "serve", *self.serve_args, "--host", self.host,
                   "--port", str(self.port)]
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT if log is not None else None,
                                        start_new_session=True, preexec_fn=_end_with_parent)

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (the server drains), then SIGKILL of the whole group past `timeout`."""
        if self.process is None:
            return
        if self.process.poll() is None:
            _signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(self.process.pid, signal.SIGKILL)
        self.process.wait()


def _end_with_parent() -> None:
    """In the child before exec: SIGTERM it when the process that started it dies, even by SIGKILL (Linux's
    PR_SET_PDEATHSIG; elsewhere nothing), so no replica outlives its router."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def start_replicas(count: int, serve_args: list[str], timeout: float = 600.0,
                   log: int | None = None) -> list[LocalReplica]:
    """`count` replicas of `serve MODEL ...` (`serve_args` without --host / --port), all healthy, or none left
    running and a RuntimeError naming the one that failed."""
    if count < 1:
        raise ValueError(f"the number of replicas must be >= 1, got {count}")
    if any(arg in ("--port", "--host") or arg.startswith(("--port=", "--host=")) for arg in serve_args):
        raise ValueError("the router picks each local replica's --host and --port; leave them out")
    replicas = [LocalReplica(list(serve_args)) for _ in range(count)]
    try:
        for replica in replicas:
            replica.start(log)
        deadline = time.monotonic() + timeout
        waiting = list(replicas)
        while waiting:
            for replica in list(waiting):
                assert replica.process is not None
                if replica.process.poll() is not None:
                    raise RuntimeError(f"replica on port {replica.port} exited with {replica.process.returncode}")
                if replica.healthy():
                    waiting.remove(replica)
            if waiting and time.monotonic() > deadline:
                raise RuntimeError(f"replicas on ports {[r.port for r in waiting]} not healthy after {timeout:g} s")
            time.sleep(0.2)
    except BaseException:
        stop_replicas(replicas)
        raise
    return replicas


def stop_replicas(replicas: list[LocalReplica], timeout: float = 30.0) -> None:
    """SIGTERM to all at once (each drains its requests), SIGKILL to those still running after `timeout`."""
    for replica in replicas:
        if replica.process is not None and replica.process.poll() is None:
            _signal_group(replica.process.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for replica in replicas:
        replica.stop(timeout=max(0.1, deadline - time.monotonic()))
