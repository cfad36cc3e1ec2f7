"""ckptkit.browse in a real browser: Voilà serves a notebook on 127.0.0.1, headless Chromium
(driven by Playwright) types a filter and clicks tensors; the statistics and the chunk picture
must appear and change with the selection. A screenshot goes to the test's tmp_path and to
build/browser/."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import nbformat
import pytest
from safetensors.torch import save_file

import ckptkit

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOT_DIR = ROOT / "build" / "browser"
TIMEOUT_MS = 120_000  # kernel start + import + first render, on a busy 2-core machine

pytestmark = pytest.mark.slow


def _require_browser_tools() -> None:
    missing = []
    if not CHROMIUM.exists():
        missing.append(f"{CHROMIUM} (apt-get install -y chromium)")
    for module in ("voila", "playwright"):
        if importlib.util.find_spec(module) is None:
            missing.append(f"{module} (pip install -e .[test])")
    if missing:
        pytest.skip(
            "real-browser test needs " + ", ".join(missing) + "; enable it with "
            "`apt-get install -y chromium` and `pip install -e .[test]` (never `playwright install`)"
        )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_port(port: int, server: subprocess.Popen, log: Path, timeout: float = 90) -> None:
    """Until the port accepts a connection (never GET /: each GET starts a kernel)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"voila exited with {server.returncode}:\n{log.read_text()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(
        f"voila did not listen on 127.0.0.1:{port} in {timeout}s:\n{log.read_text()}"
    )


def _stop(server: subprocess.Popen) -> None:
    """SIGTERM the server's process group (voila and the kernels it started), then SIGKILL."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=15)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)  # kernels that outlived voila


def _loopback_only(route) -> None:
    url = urlsplit(route.request.url)
    if url.scheme in ("data", "blob") or url.hostname in ("127.0.0.1", "localhost"):
        route.continue_()
    else:
        route.abort()  # the page links CDN assets; nothing may leave the machine


def _write_notebook(path: Path, checkpoint: Path, other: Path) -> None:
    source = f"import ckptkit\n\nckptkit.browse({str(checkpoint)!r}, compare_to={str(other)!r})"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source)]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(nb, path)


def _stat_text(value: float) -> str:
    return f"{value:.6g}"  # as the statistics panel prints it


def test_browse_in_chromium(written, tmp_path):
    _require_browser_tools()
    from playwright.sync_api import sync_playwright

    sample = written("fsdp2_ws2")
    checkpoint = sample.path
    ckpt = ckptkit.open(str(checkpoint))
    # The other side: the model's weights as one safetensors file, model.odd edited.
    model = sample.reference()["model"]
    model["odd"] = model["odd"] + 0.25
    other = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.items()}, str(other))
    keys = ckpt.tensors["key"].tolist()
    odd_keys = [k for k in keys if "odd" in k]
    embed_keys = [k for k in keys if "embed.weight" in k]
    odd = ckpt.read_numpy("model.odd")
    embed = ckpt.read_numpy("model.embed.weight")

    notebook = tmp_path / "browse.ipynb"
    _write_notebook(notebook, checkpoint, other)
    port = _free_port()
    log = tmp_path / "voila.log"
    started = time.monotonic()
    with log.open("w") as out:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "voila",
                notebook.name,
                "--no-browser",
                f"--port={port}",
                "--Voila.ip=127.0.0.1",
                "--Voila.port_retries=0",
                "--show_tracebacks=True",
            ],
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so its kernels stop with it
        )
    try:
        _wait_for_port(port, server, log)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 800})
                page.set_default_timeout(TIMEOUT_MS)
                page.route("**/*", _loopback_only)
                page.goto(f"http://127.0.0.1:{port}/", wait_until="domcontentloaded")
                page.wait_for_selector(".ckptkit-list select")
                summary = page.locator(".ckptkit-summary")
                assert f"of {len(keys)} tensors" in summary.inner_text()
                assert page.locator(".ckptkit-list option").count() == len(keys)
                for menu, label in (("group", "all groups"), ("dtype", "all dtypes")):
                    shown = page.locator(f".ckptkit-{menu} select option:checked").inner_text()
                    shown = shown.replace("\xa0", " ")  # ipywidgets renders spaces as nbsp
                    assert shown == label, f"the {menu} menu shows {shown!r}"

                # Type a filter: the list and the counts follow.
                _type_filter(page, "embed.weight")
                _wait_for_options(page, embed_keys)
                assert summary.inner_text().startswith(f"{len(embed_keys)} of {len(keys)}")

                # Select a tensor: its statistics, chunk picture and diff appear.
                stats = page.locator(".ckptkit-stats")
                layout = page.locator("img.ckptkit-layout")
                histogram = page.locator("img.ckptkit-histogram")
                diff = page.locator(".ckptkit-diff")
                page.select_option(".ckptkit-list select", label="model.embed.weight")
                _wait_for_stats(page, previous="")
                first_stats = stats.inner_text()
                assert _stat_text(embed.min()) in first_stats
                assert _stat_text(embed.max()) in first_stats
                assert "model.embed.weight" in page.locator(".ckptkit-meta").inner_text()
                diff.get_by_text("equal").wait_for()
                first_layout, first_histogram = layout.screenshot(), histogram.screenshot()

                # Another filter, narrowed with the group menu, and another tensor: all change.
                _type_filter(page, "odd")
                _wait_for_options(page, odd_keys)
                page.select_option(".ckptkit-group select", label="model")
                _wait_for_options(page, ["model.odd"])
                page.select_option(".ckptkit-list select", label="model.odd")
                _wait_for_stats(page, previous=first_stats)
                second_stats = stats.inner_text()
                assert _stat_text(odd.min()) in second_stats
                assert _stat_text(odd.max()) in second_stats
                assert "model.odd" in page.locator(".ckptkit-meta").inner_text()
                diff.get_by_text("different").wait_for()
                assert "0.25" in diff.inner_text()  # max_abs of the edit
                page.wait_for_timeout(300)  # let the new PNGs decode before comparing pixels
                assert layout.screenshot() != first_layout
                assert histogram.screenshot() != first_histogram

                shot = tmp_path / "browse.png"
                page.screenshot(path=str(shot), full_page=True)
            finally:
                browser.close()
    finally:
        _stop(server)
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, SCREENSHOT_DIR / "browse.png")
    print(f"screenshot: {SCREENSHOT_DIR / 'browse.png'} ({time.monotonic() - started:.1f}s)")


def _type_filter(page, text: str) -> None:
    box = page.locator(".ckptkit-filter input")
    box.fill("")
    box.press_sequentially(text, delay=30)  # as a person types: one update per key


def _wait_for_options(page, keys: list[str]) -> None:
    page.wait_for_function(
        "keys => JSON.stringify([...document.querySelectorAll('.ckptkit-list option')]"
        ".map(o => o.textContent)) === JSON.stringify(keys)",
        arg=keys,
    )


def _wait_for_stats(page, previous: str) -> None:
    """Until the statistics panel shows new numbers and both pictures are decoded."""
    page.wait_for_function(
        "before => { const t = document.querySelector('.ckptkit-stats').innerText;"
        " return t.includes('mean') && t !== before }",
        arg=previous,
    )
    for selector in ("img.ckptkit-layout", "img.ckptkit-histogram"):
        page.wait_for_function(
            "s => { const img = document.querySelector(s);"
            " return img && img.complete && img.naturalWidth > 0 }",
            arg=selector,
        )
