"""`r1 serve` stopped mid-request: seconds from SIGINT (or SIGTERM) to the process gone, and what its clients got.

usage: python benchmarks/serve_stop.py [--busy 2] [--requests 4] [--pairs 2] [--rev REV] [--signal INT]

Serves the embedded tiny model (`r1 serve tiny`, a process of its own) with `--busy` processes spinning beside it
(load), sends `--requests` completions of 8 choices each as long as the context allows (half of them streamed),
waits until text flows, sends the signal and times the process until it is gone. With `--rev`, the same is done in
turns with the code at that commit (a git worktree). One JSON line a run: seconds to gone, clients answered whole
(200), cut with the shutdown's 503 (or its error event), or left with a broken connection.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def _spin() -> None:
    while True:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _client(url: str, streamed: bool, said: list) -> None:
    body = {"model": "tiny", "prompt": "Once upon a time", "n": 8, "max_tokens": 480, "temperature": 1.0}
    try:
        if streamed:
            with httpx.stream("POST", f"{url}/completions", json={**body, "stream": True}, timeout=120) as r:
                lines = [line for line in r.iter_lines() if line]
            last = lines[-1] if lines else ""
            said.append("whole" if last == "data: [DONE]" else "cut 503" if "shutting down" in last else "broken")
        else:
            r = httpx.post(f"{url}/completions", json=body, timeout=120)
            said.append("whole" if r.status_code == 200 else
                        "cut 503" if r.status_code == 503 and "shutting down" in r.text else f"http {r.status_code}")
    except httpx.HTTPError as e:
        said.append(f"broken ({type(e).__name__})")


def one(tree: Path, busy: int, requests: int, sig: int) -> dict:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "tiny", "--port", str(port)], cwd=tree,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"r1 serve did not start: {proc.stderr.read()[-2000:]}")
        time.sleep(0.2)
    spinners = [mp.Process(target=_spin, daemon=True) for _ in range(busy)]
    for s in spinners:
        s.start()
    said: list[str] = []
    clients = [threading.Thread(target=_client, args=(url, i % 2 == 1, said)) for i in range(requests)]
    for c in clients:
        c.start()
    time.sleep(2.0)  # the requests decode
    t0 = time.monotonic()
    proc.send_signal(sig)
    try:
        proc.wait(timeout=120)
        gone = round(time.monotonic() - t0, 2)
    except subprocess.TimeoutExpired:
        proc.kill()
        gone = None
    for c in clients:
        c.join(timeout=120)
    for s in spinners:
        s.kill()
    return {"seconds_to_gone": gone, "clients": sorted(said), "busy": busy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--busy", type=int, default=2, help="processes spinning beside the server")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--rev", default=None, help="also run the code at this commit, in turns")
    parser.add_argument("--signal", default="INT", choices=["INT", "TERM"])
    args = parser.parse_args()
    sig = signal.SIGINT if args.signal == "INT" else signal.SIGTERM
    from worktrees import worktree

    import contextlib

    with (worktree(args.rev) if args.rev else contextlib.nullcontext()) as old:
        for _ in range(args.pairs):
            if old is not None:
                print(json.dumps({"code": args.rev, **one(old, args.busy, args.requests, sig)}), flush=True)
            print(json.dumps({"code": "now", **one(ROOT, args.busy, args.requests, sig)}), flush=True)


if __name__ == "__main__":
    main()
