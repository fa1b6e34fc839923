"""The first second of `r1 run`, as a new user meets it: how long until its first line, and until a bad data file
is told.

Each measurement is a fresh `r1` process on a fresh state folder (no MLFLOW_TRACKING_URI, no PREFECT_API_URL: the
embedded default), timed from its start by the wall clock:

- first line: `r1 run` on the tiny recipe, until it prints its first line on stdout;
- checked: the same process, until its "checked; starting on ..." line (every check passed and the stages' libraries
  loaded: the run starts next); then it is stopped (SIGTERM to its process group, SIGKILL after 10 s) before it
  trains;
- bad data: `r1 run --stages cold_start_sft --set cold_start_sft.data.source=<a JSONL file whose row 1 lacks
  'response'>`, until it exits (code 2, one line on stderr).

With `--before <a checkout>` the same commands also run from that checkout (its code first on PYTHONPATH), in turns
with this one, so both meet the same load.

    .venv/bin/python benchmarks/cli_first_second.py --repeats 5 --before <a worktree at main>
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BAD_ROWS = ('{"prompt": "2+2?", "response": "<think>2+2=4</think><answer>4</answer>"}\n'
            '{"prompt": "3+3?"}\n')  # row 1 has no 'response'


def _env(root: Path, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "PREFECT_HOME")}
    return {**env, "R1_HOME": str(home), "PYTHONPATH": str(root)}


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def first_lines(root: Path) -> tuple[float, str, float]:
    """Seconds from the start of `r1 run` to its first line on stdout, the line, and seconds to its "checked;" line
    (every check passed, the stages' libraries loaded: the run starts next)."""
    with tempfile.TemporaryDirectory() as home:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run"], cwd=root, env=_env(root, Path(home)),
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        try:
            first = proc.stdout.readline()
            seconds = time.perf_counter() - start
            line = first
            while line and not line.startswith("checked;"):
                line = proc.stdout.readline()
            checked = time.perf_counter() - start
        finally:
            _stop(proc)
            proc.stdout.close()
    if not line:
        raise SystemExit(f"{root}: `r1 run` printed no 'checked;' line (exit {proc.returncode}): {first!r}")
    return seconds, first.strip(), checked


def bad_data(root: Path, data: Path) -> tuple[float, str]:
    """Seconds from the start of `r1 run` on a bad data file to its exit, and the line it told."""
    with tempfile.TemporaryDirectory() as home:
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--stages", "cold_start_sft", "--set",
                               f"cold_start_sft.data.source={data}"], cwd=root, env=_env(root, Path(home)),
                              capture_output=True, text=True, timeout=600)
        seconds = time.perf_counter() - start
    line = done.stderr.strip()
    if done.returncode != 2 or "row 1, column 'response'" not in line:
        raise SystemExit(f"{root}: expected exit 2 naming row 1, column 'response'; got {done.returncode}: "
                         f"{line[-2000:]}")
    return seconds, line


def cpu() -> str:
    name = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), "unknown CPU")
    flags = Path("/proc/cpuinfo").read_text()
    return f"{name}, {os.cpu_count()} cores, avx512_bf16 {'yes' if ' avx512_bf16' in flags else 'no'}"


def _figures(seconds: list[float]) -> str:
    return (f"median {statistics.median(seconds):.2f} s (min {min(seconds):.2f}, max {max(seconds):.2f}; "
            + ", ".join(f"{s:.2f}" for s in seconds) + ")")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--before", type=Path, default=None, help="a checkout of the code to compare against")
    args = parser.parse_args()
    roots = {"this": ROOT, **({"before": args.before.resolve()} if args.before else {})}
    print(f"{cpu()}; load {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the start")
    times: dict[tuple[str, str], list[float]] = {}
    lines: dict[tuple[str, str], str] = {}
    with tempfile.TemporaryDirectory() as work:
        data = Path(work) / "bad.jsonl"
        data.write_text(BAD_ROWS)
        for i in range(args.repeats):
            order = list(roots) if i % 2 == 0 else list(reversed(roots))  # in turns: each goes first half the time
            for name in order:
                seconds, line, checked = first_lines(roots[name])
                told, error = bad_data(roots[name], data)
                for what, s, text in (("first line", seconds, line), ("checked", checked, "checked; starting ..."),
                                      ("bad data", told, error)):
                    times.setdefault((name, what), []).append(s)
                    lines[(name, what)] = text
                    print(f"  repeat {i + 1}, {name:<6} {what:<10} {s:6.2f} s", flush=True)
    print(f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end")
    for (name, what), seconds in times.items():
        print(f"{name} ({roots[name]}), {what}: {_figures(seconds)}")
        print(f"    {lines[(name, what)][:160]}")
    if args.before:
        for what in ("first line", "checked", "bad data"):
            ratio = statistics.median(times[("before", what)]) / statistics.median(times[("this", what)])
            print(f"{what}: {ratio:.2f}x sooner than before")


if __name__ == "__main__":
    main()
