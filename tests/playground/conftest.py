"""Fixtures for the playground tests: Debian's chromium (installed here when missing, never downloaded by
playwright), a headless browser driven by playwright, and real `reasoning-engine serve` processes.

The model is the bundled tiny reasoning model when its files exist, else a tiny random checkpoint (enough for the
page's mechanics; the answer tests need the bundled model and skip without it).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from server.helpers import save_random_checkpoint, wait_for

from .helpers import ARTIFACTS, BUNDLED, ROOT, Served

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def ensure_chromium() -> Path:
    """Debian's chromium, installed with apt-get when missing (as root: CI containers and our machines)."""
    if CHROMIUM.is_file():
        return CHROMIUM
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip(f"{CHROMIUM} is missing and apt-get cannot install it here (needs Debian and root)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update"], ["apt-get", "install", "-y", "chromium"]):
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if run.returncode != 0:
            pytest.fail(f"`{' '.join(command)}` failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    return CHROMIUM


@pytest.fixture(scope="package")
def browser() -> Iterator[Browser]:
    """One browser for the playground's tests, closed after them: sync Playwright keeps an event loop running in the
    main thread while it is open, and a test that calls asyncio.run after it in the same process (the suite runs in
    two worker processes, files in any order) would fail."""
    executable = ensure_chromium()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(executable), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def model_args(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """`serve`'s MODEL argument: none for the bundled model, else a random checkpoint's folder."""
    if BUNDLED is not None:
        return []
    return [str(save_random_checkpoint(tmp_path_factory.mktemp("random_kimi_llama")))]


@pytest.fixture(scope="module")
def serve(model_args: list[str]) -> Iterator[Callable[..., Served]]:
    """`serve(*options, model=None)` starts `reasoning-engine serve` (on `model`, a checkpoint folder, when given)
    on a free loopback port and waits until the playground answers; every server started is stopped (SIGTERM) when
    the module ends."""
    procs: list[subprocess.Popen[str]] = []

    def start(*options: str, model: str | None = None) -> Served:
        port = _free_port()
        log = tempfile.TemporaryFile("w+")
        proc = subprocess.Popen(
            [sys.executable, "-m", "reasoning_engine.cli", "serve", *([model] if model else model_args),
             "--host", "127.0.0.1",
             "--port", str(port), "--device", "cpu", "--kv-cache-blocks", "128", "--block-size", "16",
             "--log-level", "warning", *options],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return proc.poll() is not None

        if not wait_for(up, timeout=180, interval=0.2) or proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"the server did not start:\n{log.read()[-4000:]}")
        page = httpx.get(f"{url}/", timeout=10)
        assert page.status_code == 200 and "playground" in page.text, (
            f"GET / answered {page.status_code}: the server does not serve the playground "
            "(build_app must call mount_playground and list playground.PUBLIC_PATHS among the public paths)")
        return Served(url)

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def page(browser: Browser, request: pytest.FixtureRequest) -> Iterator[Page]:
    """A fresh browser tab (its own storage); a screenshot of its last state is kept under artifacts/playground/,
    which is where to look when a test fails. Errors in the page's own script fail the test."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    tab = context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda error: errors.append(str(error)))
    tab.set_default_timeout(120_000)
    yield tab
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    tab.screenshot(path=str(ARTIFACTS / f"{request.node.name}.png"), full_page=True)
    context.close()
    assert not errors, f"script errors in the page: {errors}"
