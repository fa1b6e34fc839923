"""The sandbox the code reward runs programs in: what a program can see and use, and that it can never run outside.

Every check is made from outside the sandbox: the caller's secret variable and files, a listener on loopback that
must accept nothing, and psutil for any process left behind (each program carries a marker string in its command
line, since the sandbox passes the program's text as an argument).

Needs bubblewrap (`apt-get install -y bubblewrap`; `make test` installs it where it may). Without it the tests that
run programs are skipped, saying how to get it, except in CI (`CI` set), where they fail.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
import uuid

import psutil
import pytest

from grpo.rewards import sandbox
from grpo.rewards.sandbox import Limits, SandboxUnavailable, check_sandbox, run_python

FAST = Limits(cpu_time_s=1, wall_time_s=3)


@pytest.fixture(scope="module")
def bwrap():
    """Skip (fail in CI) where bubblewrap cannot run a sandbox."""
    try:
        check_sandbox()
    except SandboxUnavailable as e:
        reason = f"needs a working bubblewrap: {sandbox.BWRAP_INSTALL} ({e})"
        if os.environ.get("CI"):
            pytest.fail(f"{reason} (CI is set: `make test` installs it as root; see its output)", pytrace=False)
        pytest.skip(reason)


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
    result = run_python(program, limits=Limits(wall_time_s=1.5))
    assert result.killed == "wall time" and result.exit_code is None
    assert time.monotonic() - start < 5
    assert leftovers(marker) == []


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
    with pytest.raises(SandboxUnavailable, match="does not exist"):
        check_sandbox(Limits(python=str(missing)))
    assert shutil.which("bwrap")
