"""Where the test suite's CPU goes, process by process: a pytest run under Linux process accounting.

`accton` records every process that ends (killed ones too) with its CPU time; a `.pth` file put in the virtualenv
for the run writes each Python process's command line as it starts, so each record is named by what it ran (a fork
is named by its parent). Prints one line per kind of process (count, CPU seconds, seconds each), the run's wall time
and the CPU there was to be had. Needs root and the `acct` package (Debian: `apt-get install acct`). The hook is
removed and the accounting turned off at the end, whatever happens (Ctrl-C and `kill` too). `--keep DIR` keeps the
records, to ask them more (which test started what).

    .venv/bin/python benchmarks/suite_processes.py -- -q -n 2 --dist loadfile --no-loadscope-reorder
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HOOK = """import os, sys
try:
    with open({log!r}, "a") as f:
        f.write(f"{{os.getpid()}}\\t{{os.getppid()}}\\t{{' '.join(sys.orig_argv)[:400]}}\\n")
except OSError:
    pass
"""

KINDS = [  # (pattern in the command line, kind), the first that matches
    (r"-c import sys;exec\(eval\(sys.stdin", "the xdist workers (in-process tests)"), (r"-m pytest", "pytest itself"),
    (r"prefect.engine", "Prefect flow runs on process workers"), (r"prefect worker start", "Prefect workers"),
    (r"prefect server start|prefect.server.api.server:create_app", "Prefect API servers"),
    (r"prefect\S* .*deploy", "prefect deploy"),
    (r"mlflow server|mlflow/server/uvicorn_log_config", "MLflow servers (the command and its uvicorn)"),
    (r"flows.cli.point", "sweep points"), (r"-m flows.cli|/bin/r1 ", "r1 commands"),
    (r"multiprocessing", "multiprocessing fork servers and children"),
    (r"launchers.worker|launchers.join|torch.distributed.run|accelerate", "loops launched across processes"),
    (r"ray/_private/workers", "Ray workers and actors"), (r"\bray\b", "Ray's own processes"),
]


def kind(command: str, comm: str) -> str:
    for pattern, name in KINDS:
        if re.search(pattern, command):
            return name
    if comm in ("raylet", "gcs_server") or comm.startswith("ray::"):
        return "Ray's own processes"
    if comm.startswith("chrom"):
        return "Chromium"
    return "other: " + (command.split(" ")[1][:60] if " " in command else comm)


def records(pacct: Path) -> list[tuple[str, float, int, int]]:
    """(command name, CPU seconds, pid, ppid) of each process the accounting file holds."""
    out = subprocess.run(["dump-acct", str(pacct)], capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        f = [x.strip() for x in line.split("|")]
        if len(f) > 10:  # comm | version | user | sys | elapsed | ... | pid | ppid | ... (centiseconds)
            rows.append((f[0], (float(f[2]) + float(f[3])) / 100, int(f[9]), int(f[10])))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pytest_args", nargs="*", help="what to pass to pytest (after --)")
    parser.add_argument("--keep", type=Path, help="a folder to keep the records in (argv.log: pid, ppid, command "
                        "line of each Python process; processes.tsv: command name, CPU s, pid, ppid, kind)")
    args = parser.parse_args()
    for tool in ("accton", "dump-acct"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} not found: install the acct package (apt-get install acct), as root")
    work = Path(tempfile.mkdtemp(prefix="r1-acct-"))
    log, pacct = work / "argv.log", work / "pacct"
    site = Path(sysconfig.get_paths()["purelib"])
    hook, pth = site / "r1_suite_processes_hook.py", site / "zz_r1_suite_processes.pth"
    pacct.touch()
    hook.write_text(HOOK.format(log=str(log)))
    pth.write_text("import r1_suite_processes_hook\n")
    started = time.monotonic()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `kill`: the hook and the accounting are undone too
    try:
        subprocess.run(["accton", str(pacct)], check=True, capture_output=True)
        code = subprocess.run([sys.executable, "-m", "pytest", *args.pytest_args], cwd=ROOT).returncode
    finally:
        subprocess.run(["accton", "off"], check=False, capture_output=True)
        pth.unlink(missing_ok=True)
        hook.unlink(missing_ok=True)
    wall = time.monotonic() - started
    commands = {}
    for line in log.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) == 3:
            commands[int(parts[0])] = parts[2]
    rows = records(pacct)
    parents = {pid: ppid for _, _, pid, ppid in rows}

    def name(comm: str, pid: int) -> str:
        if pid not in commands and parents.get(pid) in commands:
            return kind(commands[parents[pid]], comm) + " (forks)"
        return kind(commands.get(pid, ""), comm)

    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for comm, cpu, pid, _ in rows:
        t = totals[name(comm, pid)]
        t[0] += 1
        t[1] += cpu
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        shutil.copy(log, args.keep / "argv.log")
        (args.keep / "processes.tsv").write_text("".join(f"{comm}\t{cpu:.2f}\t{pid}\t{ppid}\t{name(comm, pid)}\n"
                                                         for comm, cpu, pid, ppid in rows))
    used = sum(t[1] for t in totals.values())
    print(f"pytest exited {code}; {wall:.0f} s of wall time, {used:.0f} s of CPU in {len(rows)} processes "
          f"({used / (wall * os.cpu_count()):.0%} of the {os.cpu_count()} cores' time)")
    for label, (n, cpu) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        if cpu >= 1:
            print(f"{cpu:8.1f} s CPU  {n:5d} processes  {cpu / n:6.2f} s each  {label}")
    shutil.rmtree(work, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
