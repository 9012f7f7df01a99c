"""Draw docs/tree-page*.png: the tree page in headless Chromium, on the tiny
preset, after a dropped turn, with a canonical branch, and with a tool wait
on the host.

    .venv/bin/python docs/screenshots.py [--browser chromium]
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

DOCS = Path(__file__).resolve().parent


def serve(rt):
    import uvicorn

    from session_runtime.api.app import create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(create_app(rt), host="127.0.0.1", log_level="warning"))
    threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not srv.started:
        time.sleep(0.05)
    return srv, f"http://127.0.0.1:{sock.getsockname()[1]}"


def shot(browser: str, url: str, path: Path, height: int) -> None:
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--user-data-dir={profile}", "--virtual-time-budget=3000", f"--window-size=1280,{height}",
                        f"--screenshot={path}", url], check=True, capture_output=True, timeout=120)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--browser", default="chromium")
    args = ap.parse_args()
    from session_runtime import Runtime, RuntimeConfig

    rt = Runtime(RuntimeConfig(model="tiny", page_size=16, pool_tokens=8192, max_context=4096), background=False)
    system = "You are a careful agent. Think first, then answer in one short sentence. " * 2
    dropped = rt.create_conversation(system, materialize="never")
    rt.send_message(dropped, "What is the capital of France?", forced={"reasoning": "The capital is Paris. " * 6,
                                                                        "content": "Paris."})
    rt.send_message(dropped, "And of Italy?", forced={"reasoning": "Rome, of course. " * 5, "content": "Rome."})
    canonical = rt.create_conversation(system, materialize="always")
    rt.send_message(canonical, "Name a prime bigger than ten.", forced={"reasoning": "Eleven is prime. " * 6,
                                                                         "content": "11."})
    rt.materializer.run_pending()
    tool = rt.create_conversation(system, offload="always")
    rt.send_message(tool, "What time is it in Tokyo?", forced={
        "reasoning": "I need the clock tool. " * 5, "tool_calls": [{"name": "clock", "arguments": {"tz": "Asia/Tokyo"}}]})
    rt.offload.run_due()
    srv, base = serve(rt)
    try:
        page = f"{base}/debug/tree.html?refresh=0"
        shot(args.browser, page, DOCS / "tree-page.png", 1500)
        for name, cid in (("dropped", dropped), ("canonical", canonical), ("tool-wait", tool)):
            shot(args.browser, f"{page}&conversation={cid}", DOCS / f"tree-page-{name}.png", 720)
    finally:
        srv.should_exit = True
        rt.close()


if __name__ == "__main__":
    main()
