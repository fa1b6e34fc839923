"""What a login costs the MLflow server of `r1 up`: its CPU per authenticated request, with MLflow's own default (every
request's password checked by a scrypt hash) and with the credential cache `r1 up` turns on (AUTH_CACHE_TTL_S).

Each arm starts the stack's MLflow server (`flows.cli.stack.start_mlflow_server`, its basic-auth app, the admin login
`r1 up` makes) on a fresh home, then sends what a training run sends: a run created, then `--requests` metric
batches (`log_batch`) and run reads, all with the login, one at a time; then one request with a wrong password,
which must be refused. Printed per arm: the server's CPU seconds (its process and children) over the requests, CPU
ms per request, requests per second. Arms run in turns, `--pairs` times. Loopback only.

    .venv/bin/python benchmarks/stack_logins.py --requests 200 --pairs 2
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def cpu_line() -> str:
    from grpo.kernels.gemm import cpu_model

    flags = Path("/proc/cpuinfo").read_text().split()
    kind = "avx512_bf16" if "avx512_bf16" in flags else "avx512f, no avx512_bf16" if "avx512f" in flags else "AVX2 only"
    return f"{cpu_model()}, {kind}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}"


def call(url: str, login: str, body: dict | None = None) -> int:
    headers = {"Authorization": "Basic " + base64.b64encode(login.encode()).decode(),
               "Content-Type": "application/json"}
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def server_cpu(pid: int) -> float:
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def one_arm(cache_ttl_s: int, requests: int) -> dict:
    from flows.cli import credentials, stack

    with tempfile.TemporaryDirectory(prefix="r1-logins-") as tmp:
        os.environ["R1_HOME"] = tmp
        credentials.AUTH_CACHE_TTL_S = cache_ttl_s
        auth = credentials.ensure_credentials()
        home = Path(tmp)
        server, uri = stack.start_mlflow_server(home / "mlflow.db", home / "mlartifacts", stack.free_port(),
                                                home / "logs", auth)
        try:
            login = f"{auth['MLFLOW_TRACKING_USERNAME']}:{auth['MLFLOW_TRACKING_PASSWORD']}"
            api = f"{uri}/api/2.0/mlflow"
            req = urllib.request.Request(f"{api}/runs/create", data=json.dumps({"experiment_id": "0"}).encode(),
                                         method="POST", headers={"Content-Type": "application/json",
                                                                 "Authorization": "Basic " + base64.b64encode(
                                                                     login.encode()).decode()})
            with urllib.request.urlopen(req, timeout=30) as r:
                run_id = json.load(r)["run"]["info"]["run_id"]
            cpu0, t0 = server_cpu(server.pid), time.monotonic()
            for i in range(requests):
                if i % 2 == 0:
                    status = call(f"{api}/runs/log-batch", login, {"run_id": run_id, "metrics": [
                        {"key": "train/loss", "value": 1.0 / (i + 1), "timestamp": int(time.time() * 1000),
                         "step": i}]})
                else:
                    status = call(f"{api}/runs/get?run_id={run_id}", login)
                assert status == 200, status
            cpu, wall = server_cpu(server.pid) - cpu0, time.monotonic() - t0
            wrong = call(f"{api}/runs/get?run_id={run_id}", login[:-3] + "xyz")
            assert wrong == 401, f"a wrong password got {wrong}"
        finally:
            stack.stop_process(server)
    return {"cpu_s": cpu, "cpu_ms_per_request": 1000 * cpu / requests, "requests_per_s": requests / wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()
    from flows.cli import credentials

    arms = {"MLflow's default (no cache)": 0, f"r1 up (cache {credentials.AUTH_CACHE_TTL_S} s)":
            credentials.AUTH_CACHE_TTL_S}
    print(f"CPU: {cpu_line()}; {args.requests} authenticated requests a run, {args.pairs} pair(s), in turns")
    results: dict[str, list[dict]] = {name: [] for name in arms}
    for _ in range(args.pairs):
        for name, ttl in arms.items():
            results[name].append(one_arm(ttl, args.requests))
    for name, rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"{name:32s} server CPU {med['cpu_s']:6.2f} s, {med['cpu_ms_per_request']:6.2f} ms a request, "
              f"{med['requests_per_s']:6.1f} requests/s (median of {len(rows)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
