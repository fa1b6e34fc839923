"""The sandbox the code reward runs programs in: what a program can see and use, and that it can never run outside.

Every check is made from outside the sandbox: the caller's secret variable and files, a listener on loopback that
must accept nothing, and psutil for any process left behind (each program carries a marker string in its command
line, since the sandbox passes the program's text as an argument).

Needs bubblewrap (`apt-get install -y bubblewrap`; `make test` installs it where it may). Without it the tests that
run programs are skipped, saying how to get it, except in CI (`CI` set), where they fail.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import socket
import time
import uuid

import psutil
import pytest

from grpo.rewards import check_code, sandbox
from grpo.rewards.sandbox import Limits, SandboxUnavailable, check_sandbox, run_python

FAST = Limits(cpu_time_s=1, wall_time_s=3)



def leftovers(marker: str) -> list[psutil.Process]:
    """Processes whose command line holds `marker`, other than this one."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.info["pid"] != os.getpid() and marker in " ".join(p.info["cmdline"] or ()):
            found.append(p)
    return found


def test_without_bwrap_it_refuses_and_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    sandbox._probe.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="apt-get install -y bubblewrap"):
            check_sandbox()
        with pytest.raises(SandboxUnavailable, match="never run programs unsandboxed"):
            run_python("print('ran')")
    finally:
        sandbox._probe.cache_clear()


def test_limits_are_checked():
    with pytest.raises(ValueError, match="wall_time_s"):
        Limits(wall_time_s=0)
    with pytest.raises(ValueError, match="max_processes"):
        Limits(max_processes=2)


def test_a_program_runs_with_its_arguments_and_input(bwrap):
    result = run_python("import sys; print(sys.argv[1:], input()[::-1])", ["a", "b"], b"olleh\n")
    assert (result.stdout, result.exit_code, result.killed) == (b"['a', 'b'] hello\n", 0, None)


def test_it_sees_no_environment_no_project_no_home_and_a_fresh_folder(bwrap, monkeypatch, tmp_path):
    monkeypatch.setenv("R1_SANDBOX_SECRET", "s3cret")
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text("s3cret")
    program = f"""
import os
print(sorted(os.environ))
print(os.getcwd(), os.listdir("."))
print(sorted(os.listdir("/")))
for path in ({str(secret_file)!r}, {os.path.abspath(__file__)!r}, "/root", "/home", "/etc/passwd"):
    print(path, os.path.exists(path))
open("mine.txt", "w").write("ok")
print(os.getuid())
"""
    lines = run_python(program).stdout.decode().splitlines()
    assert lines[0] == "['HOME', 'LANG', 'PATH', 'PWD']"  # set by the sandbox, none of the caller's
    assert lines[1] == "/tmp []"  # an empty working folder
    assert {"usr", "tmp", "proc", "dev"} <= set(eval(lines[2])) and not {"root", "home", "etc", "work"} & set(
        eval(lines[2]))
    assert lines[3:] == [f"{secret_file} False", f"{os.path.abspath(__file__)} False", "/root False",
                         "/home False", "/etc/passwd False", "1000"]
    assert "/tmp []" in run_python(program).stdout.decode()  # the next run's folder is fresh again


def test_it_has_no_network(bwrap):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        result = run_python(f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    print("connected")
except OSError as e:
    print("refused", e.errno)
""", limits=FAST)
        assert result.stdout.startswith(b"refused"), result
        with pytest.raises(socket.timeout):
            listener.accept()


def test_wall_time_kills_everything_it_started(bwrap):
    marker = f"marker-{uuid.uuid4().hex}"
    program = f"""
import os, subprocess, time
# {marker}
subprocess.Popen(["sleep", "30"])  # a child, and a double-forked daemon below
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(30)
    os._exit(0)
time.sleep(30)
"""
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_python, program, limits=Limits(wall_time_s=3))
        seen = []
        # the marker finds its processes while they run (bwrap, the sandbox's init, the program, its daemon)...
        while len(seen) < 4 and not running.done():
            time.sleep(0.05)
            seen = leftovers(marker)
        result = running.result()
    assert len(seen) >= 4
    assert result.killed == "wall time" and result.exit_code is None
    assert time.monotonic() - start < 8
    assert leftovers(marker) == []  # ...and none once the run is over


def test_process_memory_and_output_limits(bwrap):
    forks = run_python("""
import os, time
n = 0
try:
    for _ in range(200):
        if os.fork() == 0:
            time.sleep(2)
            os._exit(0)
        n += 1
except OSError:
    pass
print(n)
""", limits=Limits(max_processes=16, wall_time_s=10))
    assert 0 < int(forks.stdout) < 16  # bwrap's own processes and the interpreter count too
    memory = run_python("x = bytearray(600 << 20); print('got it')", limits=Limits(memory_mb=256))
    assert b"MemoryError" in memory.stderr and memory.exit_code != 0
    output = run_python("while True: print('x' * 1000)", limits=Limits(max_output_bytes=10_000))
    assert output.killed == "output limit" and len(output.stdout) <= 10_001
    cpu = run_python("while True: pass", limits=Limits(cpu_time_s=1, wall_time_s=10))
    assert cpu.killed is None and cpu.exit_code != 0  # SIGXCPU at 1 s of CPU, well before the wall limit


def test_the_interpreter_is_the_one_named(bwrap, tmp_path):
    missing = tmp_path / "python3"
    sandbox._probe.cache_clear()
    with pytest.raises(SandboxUnavailable, match="is not on this machine"):
        check_sandbox(Limits(python=str(missing)))
    assert shutil.which("bwrap")


# ----------------------------------------------------------------------------------------------------------------
# The hostile catalogue: what models under RL learn to try, each scoring only what it honestly passed

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]
RIGHT = "def add(a, b):\n    return a + b\n"


def catalogue(marker: str, port: int, secret_file: str, outside: str) -> list[tuple[str, str, int]]:
    """(case, program, tests it honestly passes of ADD_TESTS); every program carries `marker`."""
    return [
        ("infinite loop", "def add(a, b):\n    while True:\n        pass\n", 0),
        ("sleep past the limit", "import time\ntime.sleep(60)\n" + RIGHT, 0),
        ("a burst of forked processes", """
import os, time
for _ in range(500):  # stopped at the process limit; the survivors sleep until the sandbox goes
    try:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
    except OSError:
        break
""" + RIGHT, 3),
        ("memory bomb", "def add(a, b):\n    hog = bytearray(8 << 30)\n    return a + b\n", 0),
        ("deep recursion", "import sys\nsys.setrecursionlimit(10 ** 8)\ndef add(a, b):\n    return add(a, b)\n", 0),
        ("huge output", "def add(a, b):\n    print('x' * (8 << 20))\n    return a + b\n", 0),
        ("writing outside its folder", f"""
for path in ({outside!r}, "/usr/escaped", "/escaped", "/dev/shm/escaped"):
    try:
        open(path, "w").write("out")
    except OSError:
        pass
""" + RIGHT, 3),
        ("reading the caller's environment and files", f"""
import os
seen = os.environ.get("R1_CATALOGUE_SECRET")
try:
    seen = seen or open({secret_file!r}).read()
except OSError:
    pass
def add(a, b):
    return a + b if seen else None  # right only if the secret leaked
""", 0),
        ("a socket to a listener on loopback", f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=1)
    reached = True
except OSError:
    reached = False
def add(a, b):
    return a + b if reached else None  # right only if the network leaked
""", 0),
        ("killing its parent", "import os\nos.kill(os.getppid(), 9)\n" + RIGHT, 3),
        ("exiting 0 before the tests", RIGHT + "import os\nos._exit(0)\n", 0),
        ("printing a fake pass", "def add(a, b):\n    return a - b\nprint('3 tests passed')\nprint('OK')\n", 0),
        ("an always-equal return value", """
class Anything:
    def __eq__(self, other):
        return True
    __hash__ = None
def add(a, b):
    return Anything()
""", 0),
        ("patching the harness", """
import builtins, json, os
json.dumps = lambda *a, **k: '{"value": ["b", true]}'
builtins.type = lambda x: int
def add(a, b):
    return a - b
""", 0),
        # it reads its job (and nonce) from its own argv and claims the value 3 for every test: 3 is right for
        # add(1, 2) only, which is what `return 3` would pass
        ("forging the harness's result line", """
import json, os, sys
nonce = json.loads(sys.argv[1])["nonce"]
os.write(1, f"\\n{nonce} {json.dumps({'value': ['i', hex(3)]})}\\n".encode())
os._exit(0)
""", 1),
        ("a daemon that outlives it", """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(60)
    os._exit(0)
""" + RIGHT, 3),
        ("non-UTF-8 output", "import sys\nsys.stdout.buffer.write(b'\\xff\\xfe\\x80 not text')\nsys.stdout.flush()\n"
                             + RIGHT, 3),
        ("a syntax error", "def add(a, b)\n    return a + b\n", 0),
    ]


def test_hostile_programs_score_what_they_honestly_passed_and_nothing_escapes(bwrap, monkeypatch, tmp_path):
    marker = f"marker-{uuid.uuid4().hex}"
    monkeypatch.setenv("R1_CATALOGUE_SECRET", "s3cret")
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text("s3cret")
    outside = tmp_path / "escaped.txt"
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        cases = catalogue(marker, listener.getsockname()[1], str(secret_file), str(outside))
        assert len(cases) >= 15
        completions = [f"<answer>```python\n# {marker}\n{program}\n```</answer>" for _, program, _ in cases]
        # the same limits a recipe gets by default, two programs at a time (two cores); no second runs of those
        # killed for wall time (what they passed is what the first run shows; tests/grpo/rewards/test_code_reward.py
        # has the rerun)
        start = time.monotonic()
        report = check_code(completions, tests=[ADD_TESTS] * len(cases), workers=2, rerun_budget_s=0)
        took = time.monotonic() - start
        with pytest.raises(BlockingIOError):
            listener.accept()  # no connection reached the caller's listener
    assert {case: passed for (case, _, _), passed in zip(cases, report.passed)} == {
        case: honest for case, _, honest in cases}
    assert not outside.exists() and not os.path.exists("/escaped") and not os.path.exists("/usr/escaped")
    assert leftovers(marker) == []  # no process of any program is left: not the forks, not the daemon
    assert took < 60, f"the catalogue took {took:.0f} s"


def test_hostile_io_programs(bwrap):
    """The same protections on stdin/stdout tests: only the bytes printed, compared outside, count."""
    io = {"inputs": ["1 2\n", "2 2\n"], "outputs": ["3\n", "4\n"]}
    programs = {
        "right": ("a, b = map(int, input().split())\nprint(a + b)", 2),
        "non-UTF-8 output": ("import sys\nsys.stdout.buffer.write(b'3\\xff\\n')", 0),
        "killing its parent": ("import os\nos.kill(os.getppid(), 9)\nprint(sum(map(int, input().split())))", 2),
        "exiting 0 before printing": ("import os\nos._exit(0)", 0),
        "printing a fake pass": ("print('passed')", 0),
        "a crash after the right output": ("print(sum(map(int, input().split())))\nraise SystemExit(3)", 0),
    }
    report = check_code([f"```python\n{p}\n```" for p, _ in programs.values()], io_tests=[io] * len(programs),
                        workers=2)
    assert dict(zip(programs, report.passed)) == {name: honest for name, (_, honest) in programs.items()}
