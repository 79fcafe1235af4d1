"""Regenerate the pictures in docs/ from `make serve` running the sample job.

    .venv/bin/python docs/screenshots.py        # about 5 minutes on 2 cores

What it does, as an operator would:

1. copies the working tree (tracked and new files, nothing ignored) to .lowtide/screenshots/repo,
   so the runs use the default paths (`lowtide.duckdb`, `.lowtide/state.duckdb`) and nothing of
   this checkout's own runs, Prefect history or files shows;
2. starts `deployments/serve.sh` there (what `make serve` runs: a Prefect server, the emulator,
   the deployments and a worker) on free ports;
3. runs the nightly deployment on the sample job (data/jobs/support-intents.toml, 3,000 rows)
   twice: the first night asks every request, the second answers the rows from the cache;
4. opens the UI in headless Chromium (Debian's `chromium`, driven by Playwright) and writes
   docs/ui-deployments.png, docs/ui-run-artifacts.png and docs/ui-run-table.png (first night),
   docs/ui-run-report.png (second night: the report with the two nights' charts), and
   docs/report.png (`lowtide report support-intents` of the two nights);
5. stops serve.sh (Ctrl-C's path: worker, emulator, server).

It checks what it shows (the run completed with 3,000 rows; the report's charts loaded as images
in the UI) and fails rather than write a picture of an error page.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from playwright.sync_api import Page, expect, sync_playwright

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
WORK = REPO / ".lowtide" / "screenshots"
BIN = Path(sys.executable).parent
NIGHTLY = "enrich/nightly-support-intents"
JOB = "support-intents"
ROWS = 3000
VIEWPORT = {"width": 1400, "height": 1000}
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def copy_tree(target: Path) -> None:
    """The working tree as git sees it (tracked files and new, not ignored ones)."""
    if target.exists():
        shutil.rmtree(target)
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        src = REPO / name
        if src.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target / name)


def environment(root: Path, prefect_port: int, emulator_port: int) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("LOWTIDE_", "OPENAI_", "ANTHROPIC_", "PREFECT_"))
    }
    env.update(
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        VENV_BIN=str(BIN),
        PREFECT_PORT=str(prefect_port),
        EMULATOR_PORT=str(emulator_port),
        EMULATOR_TIME_SCALE="600",
        PREFECT_HOME=str(root / ".lowtide" / "prefect"),
        WORKER_NAME="lowtide-local",
    )
    return env


class Serve:
    """deployments/serve.sh of the copy, in its own process group."""

    def __init__(self, root: Path, env: dict[str, str]):
        self.log = (root / "serve.log").open("wb")
        self.proc = subprocess.Popen(
            ["bash", str(root / "deployments" / "serve.sh")],
            cwd=root,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.root = root

    def tail(self) -> str:
        return "\n".join((self.root / "serve.log").read_text(errors="replace").splitlines()[-40:])

    def stop(self) -> None:
        """SIGTERM to the script (its trap stops worker, emulator and server), then the group."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.log.close()


def wait_until(what: str, check: Any, serve: Serve, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if serve.proc.poll() is not None:
            raise SystemExit(f"serve.sh exited while waiting for {what}\n{serve.tail()}")
        with contextlib.suppress(httpx.HTTPError):
            found = check()
            if found:
                return found
        time.sleep(1.0)
    raise SystemExit(f"gave up waiting for {what} after {timeout_s:.0f} s\n{serve.tail()}")


def run_nightly(api: httpx.Client, serve: Serve) -> dict[str, Any]:
    """One run of the nightly deployment, as `prefect deployment run` starts it; its record."""
    deployment = api.get(f"/deployments/name/{NIGHTLY}").json()
    created = api.post(f"/deployments/{deployment['id']}/create_flow_run", json={})
    created.raise_for_status()
    flow_run_id = created.json()["id"]

    def finished() -> dict[str, Any] | None:
        run = api.get(f"/flow_runs/{flow_run_id}").json()
        return run if run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED") else None

    run = wait_until("the nightly run", finished, serve, 900)
    if run["state"]["type"] != "COMPLETED":
        raise SystemExit(f"the nightly run ended {run['state']['name']}\n{serve.tail()}")
    return run


def artifacts(api: httpx.Client, flow_run_id: str) -> dict[str, dict[str, Any]]:
    found = api.post(
        "/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}}
    ).json()
    return {a["key"]: a for a in found}


def open_artifacts_tab(page: Page, url: str, run: dict[str, Any]) -> None:
    page.goto(f"{url}/runs/flow-run/{run['id']}")
    expect(page.get_by_text("Completed").first).to_be_visible()
    page.get_by_role("tablist").get_by_text("Artifacts", exact=True).click()
    expect(page.locator("#artifacts-content").get_by_text(f"{JOB}-run").first).to_be_visible()


def shoot(url: str, api: httpx.Client, first: dict[str, Any], second: dict[str, Any]) -> None:
    with sync_playwright() as pw:
        chromium = shutil.which("chromium") or "/usr/bin/chromium"
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS, headless=True)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.set_default_timeout(60_000)

            page.goto(f"{url}/deployments")
            expect(page.get_by_text("At 02:00 AM every day").first).to_be_visible()
            expect(page.get_by_text("Ready", exact=True).first).to_be_visible()
            page.wait_for_load_state("networkidle")
            page.screenshot(path=str(DOCS / "ui-deployments.png"))

            open_artifacts_tab(page, url, first)
            expect(page.get_by_text(f"{ROWS:,} rows · cost").first).to_be_visible()
            page.wait_for_load_state("networkidle")
            page.screenshot(path=str(DOCS / "ui-run-artifacts.png"), full_page=True)

            page.get_by_text(f"{JOB}-run", exact=True).first.click()
            page.wait_for_url(re.compile(r"/artifacts/artifact/"))
            expect(page.locator("td").get_by_text("rows", exact=True).first).to_be_visible()
            page.wait_for_load_state("networkidle")
            page.screenshot(path=str(DOCS / "ui-run-table.png"))

            report = artifacts(api, second["id"])[f"{JOB}-report"]
            page.goto(f"{url}/artifacts/artifact/{report['id']}")
            expect(
                page.get_by_text(f"of {ROWS:,} rows succeeded", exact=False).first
            ).to_be_visible()
            images = page.locator("img[src^='data:image/svg+xml']")
            expect(images).to_have_count(4)
            page.wait_for_function(
                "() => Array.from(document.querySelectorAll(\"img[src^='data:']\"))"
                ".every(i => i.complete && i.naturalWidth > 0)"
            )
            page.wait_for_load_state("networkidle")
            # the UI scrolls inside its own pane, so a full-page shot would stop at the window:
            # make the window as tall as the report instead
            bottom = page.locator(".artifact-data-markdown").evaluate(
                "e => e.getBoundingClientRect().bottom + window.scrollY"
            )
            page.set_viewport_size({"width": VIEWPORT["width"], "height": int(bottom) + 40})
            page.wait_for_timeout(500)
            page.screenshot(path=str(DOCS / "ui-run-report.png"))

            html = WORK / "report.html"
            page.goto(html.as_uri())
            page.set_viewport_size({"width": 1240, "height": 900})
            page.screenshot(path=str(DOCS / "report.png"), full_page=True)
        finally:
            browser.close()


def main() -> None:
    root = WORK / "repo"
    copy_tree(root)
    prefect_port, emulator_port = free_port(), free_port()
    url = f"http://127.0.0.1:{prefect_port}"
    serve = Serve(root, environment(root, prefect_port, emulator_port))
    api = httpx.Client(base_url=f"{url}/api", timeout=30)
    try:
        wait_until(
            "the deployments",
            lambda: api.get(f"/deployments/name/{NIGHTLY}").is_success,
            serve,
            300,
        )
        wait_until(
            "the worker",
            lambda: any(
                w["status"] == "ONLINE"
                for w in api.post("/work_pools/lowtide/workers/filter", json={}).json()
            ),
            serve,
            120,
        )
        first = run_nightly(api, serve)
        second = run_nightly(api, serve)
        state = root / ".lowtide" / "state.duckdb"
        runs = subprocess.run(
            [str(BIN / "lowtide"), "status", "--json"],
            cwd=root,
            env={**os.environ, "LOWTIDE_STATE": str(state)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        if f'"rows": {ROWS}' not in runs:
            raise SystemExit(f"the runs do not show {ROWS} rows:\n{runs}")
        subprocess.run(
            [str(BIN / "lowtide"), "report", JOB, "--out", str(WORK / "report.html")],
            cwd=root,
            env={**os.environ, "LOWTIDE_STATE": str(state)},
            check=True,
        )
        shoot(url, api, first, second)
    finally:
        api.close()
        serve.stop()
    print("written: " + ", ".join(sorted(p.name for p in DOCS.glob("*.png"))))


if __name__ == "__main__":
    main()
