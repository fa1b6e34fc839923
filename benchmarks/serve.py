"""`r1 serve` against `transformers serve --continuous-batching` on the same checkpoint: chat requests at temperature
0 from 1, 8 and 32 concurrent clients, both servers on 127.0.0.1, each in a process of its own.

usage: python benchmarks/serve.py [--checkpoint DIR] [--requests 64] [--max-tokens 64] [--clients 1,8,32]
                                  [--rounds 2] [--slots 64] [--rev REV] [--no-peer]

The checkpoint (default: the embedded recipe's model shape, Qwen2 hidden 256, 4 layers, 2.97M parameters, with its
1,024-entry BPE tokenizer, freshly initialised with seed 0 and saved to a temporary folder). The requests: `What is
{a} + {b}?` as one user message, `--max-tokens` new tokens at most, temperature 0. For each round the two servers
take turns (ours, then the peer; the next round the same), each started, warmed up with a few requests, then sent
the `--requests` requests from each client count in turn (a client sends its next request when its reply is
back). Printed per server, round and client count: requests/s, completion tokens/s (the servers' own usage
counts), p50 and p99 latency of a request; last, the ratios at each client count. `--rev REV` gives r1 serve at
that commit a turn too, after ours (a temporary git worktree, or `R1_REV_TREES`: `benchmarks/worktrees.py`), and
`--no-peer` leaves the peer out (the code against its own past alone).

The peer runs offline on the local folder (HF_HUB_OFFLINE=1 works: `transformers serve DIR` loads it like
from_pretrained). It needs transformers' `serving` extra (in the dev extra). On a machine shared with other jobs
the figures move with the neighbours: the rounds alternate so both servers see the same weather; compare within a
round. A script that prints figures, never a test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # this checkout's code makes the checkpoint, not an installed one

from worktrees import worktree  # noqa: E402


def make_checkpoint(folder: Path) -> None:
    from grpo.configs.model import TinyModelConfig
    from grpo.tiny import build_tiny_model, build_tokenizer

    tok = build_tokenizer()
    build_tiny_model(TinyModelConfig(), tok).save_pretrained(folder)
    tok.save_pretrained(folder)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(kind: str, checkpoint: str, port: int, slots: int, log: Path,
          root: Path = ROOT) -> tuple[subprocess.Popen, str]:
    """The server's process and the model id its clients send (r1 serve: the code under `root`)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(root)}
    if kind.startswith("r1 serve"):
        cmd = [sys.executable, "-m", "flows.cli", "serve", checkpoint, "--port", str(port), "--model-name", "bench",
               "--slots", str(slots)]
        model = "bench"
    else:
        cmd = [str(BIN / "transformers"), "serve", checkpoint, "--continuous-batching", "--host", "127.0.0.1",
               "--port", str(port), "--device", "cpu", "--log-level", "warning"]
        model = checkpoint
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{kind} exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc, model
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{kind} did not answer in 300 s: {log.read_text()[-2000:]}")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, 15)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()


def bodies(model: str, n: int, max_tokens: int) -> list[dict]:
    return [{"model": model, "messages": [{"role": "user", "content": f"What is {10 + i % 90} + {20 + (7 * i) % 70}?"}],
             "max_tokens": max_tokens, "temperature": 0} for i in range(n)]


def load(port: int, requests: list[dict], clients: int) -> dict:
    """Send the requests from `clients` threads, each with its own connection; the figures."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    pools = [httpx.Client(timeout=600) for _ in range(clients)]

    def one(i: int) -> tuple[float, int]:
        t = time.perf_counter()
        r = pools[i % clients].post(url, json=requests[i])
        r.raise_for_status()
        return time.perf_counter() - t, r.json()["usage"]["completion_tokens"]

    start_t = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(one, range(len(requests))))
    wall = time.perf_counter() - start_t
    for c in pools:
        c.close()
    latencies = sorted(d[0] for d in done)
    tokens = sum(d[1] for d in done)
    return {"clients": clients, "requests": len(requests), "seconds": round(wall, 2),
            "requests_per_s": round(len(requests) / wall, 2), "completion_tokens": tokens,
            "tokens_per_s": round(tokens / wall, 1), "p50_s": round(statistics.median(latencies), 3),
            "p99_s": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--clients", default="1,8,32")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--rev", default=None, help="r1 serve at this commit takes a turn too")
    p.add_argument("--no-peer", action="store_true", help="leave transformers serve out")
    args = p.parse_args()
    with (worktree(args.rev) if args.rev else contextlib.nullcontext()) as old:
        run(args, old)


def run(args, old: Path | None) -> None:
    """The rounds: each server in turn, every client count; then the ratios."""
    clients = [int(c) for c in args.clients.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    checkpoint = args.checkpoint
    if checkpoint is None:
        checkpoint = str(work / "checkpoint")
        make_checkpoint(Path(checkpoint))
    servers = {"r1 serve": ROOT}
    if old is not None:
        servers[f"r1 serve@{args.rev}"] = old
    if not args.no_peer:
        servers["transformers serve"] = None
    results = []
    for rnd in range(args.rounds):
        for kind, root in servers.items():
            port = free_port()
            proc, model = start(kind, checkpoint, port, args.slots, work / f"{kind.replace(' ', '-')}-{rnd}.log",
                                root or ROOT)
            try:
                load(port, bodies(model, 8, args.max_tokens), 8)  # warm-up: shapes, kernels, caches
                for c in clients:
                    row = {"server": kind, "round": rnd, **load(port, bodies(model, args.requests, args.max_tokens), c)}
                    results.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                stop(proc)
    for other in [k for k in servers if k != "r1 serve"]:
        for rnd in range(args.rounds):
            for c in clients:
                ours, peer = (next(r for r in results if r["server"] == k and r["round"] == rnd and r["clients"] == c)
                              for k in ("r1 serve", other))
                print(f"round {rnd}, {c} clients: r1 serve / {other}: tokens/s "
                      f"{ours['tokens_per_s'] / peer['tokens_per_s']:.2f}x, requests/s "
                      f"{ours['requests_per_s'] / peer['requests_per_s']:.2f}x, p99 {ours['p99_s']} s vs "
                      f"{peer['p99_s']} s")


if __name__ == "__main__":
    main()
