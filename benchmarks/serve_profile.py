"""Where a token's time goes in `r1 serve`: the engine thread's pieces and the HTTP round trip, ms a token.

usage: python benchmarks/serve_profile.py [--clients 1] [--requests 64] [--max-tokens 64] [--checkpoint DIR]

The server runs in this process (`flows.cli.serve.make_server`, the engine thread as `r1 serve` sizes it), on the
checkpoint `benchmarks/serve.py` makes (or `--checkpoint`); its clients are a process of their own, each sending
the benchmark's chat requests (temperature 0) one after another on a kept connection, after 8 warm-up requests.
Each piece is timed around its call (perf_counter; the wrappers cost well under a microsecond a call):

- decode step: `Capture.run`, the model's forward over the live slots and the choice of their tokens;
- admissions: `SlotBatch._admit`, a new row's prefill (one forward over its prompt) and its place in the pages;
- slot bookkeeping: the rest of `SlotBatch.step` (rows ended, pages ahead, the rows' lengths);
- engine bookkeeping: the rest of `RequestBatcher._step` (requests released, new tokens, stop strings);
- requests in and out: `RequestBatcher._take` (chat template, tokenizing) and `_finish` (detokenizing, the
  reply handed to the HTTP thread);
- HTTP: from the reply's last byte sent to the next request's first byte in (the client's turn, the connection);
- engine idle: the engine thread waiting for work.

Prints one JSON object: tokens/s, wall ms a token, and each piece's ms a token and calls. The figures move with
the machine's load (note `uptime`); a script that prints figures, never a test.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

CLIENT = textwrap.dedent("""
    import json, sys, time, httpx
    from concurrent.futures import ThreadPoolExecutor
    port, n, clients, max_tokens = map(int, sys.argv[1:5])
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    bodies = [{"messages": [{"role": "user", "content": f"What is {10 + i % 90} + {20 + (7 * i) % 70}?"}],
               "max_tokens": max_tokens, "temperature": 0} for i in range(n)]
    pools = [httpx.Client(timeout=600) for _ in range(clients)]
    def one(i):
        r = pools[i % clients].post(url, json=bodies[i])
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, range(8)))
    print("go", flush=True)
    sys.stdin.readline()
    t = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(one, range(n)))
    print(json.dumps({"tokens": tokens, "seconds": time.perf_counter() - t}), flush=True)
""")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=1)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--checkpoint", default=None)
    args = p.parse_args()

    from flows.cli import serve as http
    from flows.cli.serve import load_checkpoint, make_server
    from grpo.sampling import batcher
    from grpo.sampling.local import slots
    from serve import make_checkpoint

    work = Path(tempfile.mkdtemp(prefix="serve-profile-"))
    checkpoint = args.checkpoint
    if checkpoint is None:
        checkpoint = str(work / "checkpoint")
        make_checkpoint(Path(checkpoint))

    spent: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()

    def timed(owner, name: str, label: str) -> None:
        f = getattr(owner, name)

        @functools.wraps(f)
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                spent[label] += time.perf_counter() - t
                calls[label] += 1
        setattr(owner, name, wrapper)

    for owner, name, label in [(batcher.RequestBatcher, "_step", "_step"), (slots.SlotBatch, "step", "step"),
                               (slots.SlotBatch, "_admit", "admissions"), (batcher.RequestBatcher, "_take", "take"),
                               (batcher.RequestBatcher, "_finish", "finish")]:
        timed(owner, name, label)
    made = slots.SlotBatch.__init__

    def init(self, *a, **kw):
        made(self, *a, **kw)
        timed(self.cap, "run", "decode step")
    slots.SlotBatch.__init__ = init
    wait = batcher.RequestBatcher._run

    def run(self):  # the engine thread's idle time: blocked on its inbox
        inbox = self._inbox
        get = inbox.get

        class Inbox:
            def __getattr__(self, name):
                return getattr(inbox, name)

            def get(self, *a, **kw):
                t = time.perf_counter()
                try:
                    return get(*a, **kw)
                finally:
                    spent["engine idle"] += time.perf_counter() - t
        self._inbox = Inbox()
        wait(self)
    batcher.RequestBatcher._run = run
    edges: list[tuple[float, float]] = []  # (request in, last byte out) of each HTTP request
    app_call = http._AccessLog.__call__

    async def logged(self, scope, receive, send):
        t = time.perf_counter()

        async def sending(message):
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                edges.append((t, time.perf_counter()))
        await app_call(self, scope, receive, sending)
    http._AccessLog.__call__ = logged

    model, tok = load_checkpoint(checkpoint, device="cpu")
    with make_server(model, tok, port=0, model_name="bench") as server:
        client = subprocess.Popen([sys.executable, "-c", CLIENT, str(server.server_address[1]), str(args.requests),
                                   str(args.clients), str(args.max_tokens)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert client.stdout.readline().strip() == "go"
        spent.clear()
        calls.clear()
        edges.clear()
        client.stdin.write("\n")
        client.stdin.flush()
        done = json.loads(client.stdout.readline())
        client.wait()
    tokens, seconds = done["tokens"], done["seconds"]
    edges.sort()
    gaps = sum(max(0.0, edges[i + 1][0] - edges[i][1]) for i in range(len(edges) - 1)) if args.clients == 1 else None

    def per_token(seconds_: float) -> float:
        return round(1000 * seconds_ / tokens, 4)

    pieces = {
        "decode step": spent["decode step"],
        "admissions": spent["admissions"],
        "slot bookkeeping": spent["step"] - spent["decode step"] - spent["admissions"],
        "engine bookkeeping": spent["_step"] - spent["step"],
        "requests in (take)": spent["take"],
        "requests out (finish)": spent["finish"],
        "engine idle": spent["engine idle"],
    }
    out = {"clients": args.clients, "requests": args.requests, "tokens": tokens,
           "tokens_per_s": round(tokens / seconds, 1), "wall_ms_a_token": per_token(seconds),
           "ms_a_token": {k: per_token(v) for k, v in pieces.items()},
           "calls": {"decode steps": calls["decode step"], "admissions": calls["admissions"],
                     "requests": calls["take"]}}
    if gaps is not None:
        out["ms_a_token"]["HTTP between requests (1 client)"] = per_token(gaps)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
