"""The sandbox: run an untrusted Python program in a process tree of its own, with no way out and hard limits.

Completions sampled under RL are untrusted code, run thousands of times an hour; one fork bomb, memory bomb or
`os.kill(os.getppid(), 9)` in a batch must not take the trainer down, and nothing may leave the sandbox. Each run:

* is started by **bubblewrap** (`bwrap`, Debian's `bubblewrap` package): a small, maintained tool (it is what
  Flatpak sandboxes apps with) that puts the program in new user, PID, network, mount, IPC, UTS and cgroup
  namespaces. We chose it over hand-written `unshare`/`chroot`/seccomp code because every one of those steps is
  easy to get subtly wrong, and over a container runtime because it needs no daemon and starts in milliseconds;
* sees only a read-only `/usr` (the interpreter, its standard library and the C libraries; an interpreter outside
  `/usr` has its own install folder bound read-only too), a minimal read-only `/dev`, its own `/proc`, and a fresh
  empty working folder (`/tmp`, a size-capped tmpfs, also its home). No project file, no home, no venv, none of
  the caller's environment variables (`--clearenv`), no inherited file descriptors but its pipes;
* has no network: its network namespace holds only its own loopback, so a listener of the caller is unreachable;
* runs as uid 1000 inside a user namespace. When the caller is root, `bwrap` itself is started as an unprivileged
  host user (`SANDBOX_HOST_UID`), because the kernel exempts root (and a namespace uid mapped to root) from
  RLIMIT_NPROC: only a non-root owner makes the process limit real;
* has limits set by a few lines of trusted code that run before anything else in the sandboxed interpreter
  (`setrlimit`: CPU seconds, address space, processes, open files, file size, no core dumps), and a wall-clock
  limit and an output cap enforced from here. `--die-with-parent` ties the sandbox to the caller, and killing the
  sandbox's PID 1 makes the kernel kill everything inside the PID namespace before `bwrap` exits: when `run_python`
  returns, nothing the program started is left (double-forked daemons included).

Where `bwrap` is missing or cannot make its namespaces (a container that forbids them), `check_sandbox` raises
`SandboxUnavailable` saying so and how to install it: code is never run outside the sandbox.

Pure Python on the standard library; must not depend on torch, Prefect or MLflow. What runs inside, and how the
verdict is kept out of the program's reach, is in `grpo.rewards.code_harness` and `grpo.rewards.code`.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import os
import selectors
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

BWRAP_INSTALL = "apt-get install -y bubblewrap"  # Debian/Ubuntu; other systems package it as bubblewrap too
SANDBOX_HOST_UID = 65534  # "nobody": who owns the sandbox on the host when the caller is root (see above)
INSIDE_UID = 1000  # the program's uid inside its user namespace
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"  # where the sandbox looks for programs: all of it under /usr
_STDERR_KEPT = 4096  # bytes of the program's stderr kept for messages; the rest is read and dropped


class SandboxUnavailable(RuntimeError):
    """bwrap is missing or cannot create its namespaces here: code is not run at all."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one sandboxed run may use (defaults like a programming judge's)."""

    cpu_time_s: float = 2.0  # CPU seconds per process (SIGXCPU, then SIGKILL a second later)
    wall_time_s: float = 5.0  # wall-clock seconds for the whole run, then everything in it is killed
    memory_mb: int = 1024  # address space per process, in MiB
    max_processes: int = 32  # processes and threads the sandbox's user may have at once
    max_open_files: int = 64  # file descriptors per process
    max_output_bytes: int = 1 << 20  # stdout beyond this kills the run
    max_file_bytes: int = 16 << 20  # largest file it may write; also the size of its working folder
    # the interpreter inside (standard library only): a path on this machine, or a name looked up in SYSTEM_PATH
    python: str = "python3"

    def __post_init__(self):
        for name in ("cpu_time_s", "wall_time_s", "memory_mb", "max_processes", "max_open_files",
                     "max_output_bytes", "max_file_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox limit {name} must be > 0, got {getattr(self, name)!r}")
        if self.max_processes < 4:  # bwrap's two processes and the interpreter count against it
            raise ValueError(f"max_processes must be at least 4 (the sandbox itself takes 3), got {self.max_processes}")


class RunResult(NamedTuple):
    stdout: bytes  # at most max_output_bytes (+1 when it was cut)
    stderr: bytes  # the first few KiB
    exit_code: int | None  # the program's exit status; None when it was killed from here
    killed: str | None  # why it was killed from here: "wall time", "output limit" or "start failed"; None otherwise
    wall_s: float  # seconds from start to the last process gone
    # the sandbox's own failure, when it never started the program (bwrap could not make its namespaces, fork
    # failed, ...): what it said. The program is not to blame: its tests are not failed but ungraded
    sandbox_error: str | None = None


# Runs first inside the sandbox: limits that only setrlimit can set, then the program, with its own argv. The
# soft CPU limit sends SIGXCPU (Python dies of it), the hard one a second later SIGKILL.
_LAUNCHER = """\
import resource, sys
for _k, _v in {rlimits!r}:
    resource.setrlimit(_k, (_v, _v + 1 if _k == resource.RLIMIT_CPU else _v))
_src = sys.argv[1]
sys.argv = ["-c", *sys.argv[2:]]
del resource, _k, _v
exec(compile(_src, "<sandboxed>", "exec"), {{"__name__": "__main__", "__builtins__": __builtins__}})
"""


def _rlimits(limits: Limits) -> list[tuple[int, int]]:
    import resource

    return [(resource.RLIMIT_CPU, max(1, round(limits.cpu_time_s))),
            (resource.RLIMIT_AS, limits.memory_mb << 20),
            (resource.RLIMIT_NPROC, limits.max_processes),
            (resource.RLIMIT_NOFILE, limits.max_open_files),
            (resource.RLIMIT_FSIZE, limits.max_file_bytes),
            (resource.RLIMIT_CORE, 0)]


def _root_links() -> list[str]:
    """/bin, /lib, /lib64, /sbin as this machine has them: symlinks into /usr (merged /usr) or folders."""
    args = []
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    return args


def interpreter(python: str) -> str | None:
    """The interpreter's path on this machine: `python` itself, or where a bare name is found on SYSTEM_PATH (the
    caller's own, say in a virtual environment or a home folder, stays out of the sandbox)."""
    if os.sep in python:
        return python if os.path.isfile(python) else None
    return shutil.which(python, path=SYSTEM_PATH)


def _interpreter_binds(python: str) -> list[str]:
    """The interpreter's install folder, read-only, when it is not under /usr (e.g. /opt/python3.11)."""
    real = Path(os.path.realpath(python))
    if real.is_relative_to("/usr"):
        return []
    prefix = real.parent.parent  # <prefix>/bin/python3 -> <prefix>, where lib/python3.X lives
    return ["--ro-bind", str(prefix), str(prefix)]


def bwrap_argv(limits: Limits, status_fd: int) -> list[str]:
    """The bwrap command line and the interpreter; see the module docstring for each part."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(f"bubblewrap (bwrap) is not installed, and code rewards never run programs "
                                 f"unsandboxed: install it ({BWRAP_INSTALL})")
    python = interpreter(limits.python)
    if python is None:
        raise SandboxUnavailable(f"no interpreter {limits.python!r} for the sandbox (looked on {SYSTEM_PATH}): "
                                 f"install python3 (apt-get install -y python3) or name one in code.python")
    return [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--uid", str(INSIDE_UID), "--gid", str(INSIDE_UID),
            "--ro-bind", "/usr", "/usr", *_root_links(), *_interpreter_binds(python),
            "--proc", "/proc", "--dev", "/dev",
            "--size", str(limits.max_file_bytes), "--tmpfs", "/tmp", "--chdir", "/tmp",
            "--remount-ro", "/dev", "--remount-ro", "/",
            "--clearenv", "--setenv", "PATH", SYSTEM_PATH, "--setenv", "HOME", "/tmp",
            "--setenv", "LANG", "C.UTF-8",
            "--json-status-fd", str(status_fd), "--", python]


def _host_user() -> dict:
    """Popen arguments that start bwrap as an unprivileged user when we are root (RLIMIT_NPROC ignores root)."""
    if os.geteuid() != 0:
        return {}
    return {"user": SANDBOX_HOST_UID, "group": SANDBOX_HOST_UID, "extra_groups": []}


def run_python(source: str, args: list[str] | tuple[str, ...] = (), stdin: bytes = b"",
               limits: Limits = Limits()) -> RunResult:
    """Run `source` (Python) in a fresh sandbox with `args` as its sys.argv[1:] and `stdin` on its standard input.

    Raises SandboxUnavailable when bwrap is missing; everything the program does is in the result. Safe to call
    from many threads at once: each call is its own process tree and only waits on it.
    """
    launcher = _LAUNCHER.format(rlimits=_rlimits(limits))
    status_r, status_w = os.pipe()
    try:
        try:
            argv = [*bwrap_argv(limits, status_w), "-I", "-S", "-B", "-c", launcher, source, *args]
            start = time.monotonic()
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    pass_fds=(status_w,), env={}, start_new_session=True, **_host_user())
        except OSError as e:  # E2BIG: a program too long for one argument (128 KiB)
            # a program too long for one argument is the program's fault (it fails); anything else, the machine's
            failed = None if e.errno == errno.E2BIG else f"cannot start the sandbox: {e}"
            return RunResult(b"", f"cannot start the sandbox: {e}".encode(), None, "start failed", 0.0, failed)
        finally:
            os.close(status_w)
        return _communicate(proc, status_r, stdin, limits, start)
    finally:
        os.close(status_r)


def _communicate(proc: subprocess.Popen, status_r: int, stdin: bytes, limits: Limits, start: float) -> RunResult:
    """Feed stdin, read stdout (capped) and stderr, and kill the sandbox at the wall-time or output limit."""
    deadline = start + limits.wall_time_s
    out, err, status = bytearray(), bytearray(), bytearray()
    sel = selectors.DefaultSelector()
    for f in (proc.stdout, proc.stderr):
        os.set_blocking(f.fileno(), False)
        sel.register(f.fileno(), selectors.EVENT_READ, f)
    sel.register(status_r, selectors.EVENT_READ, "status")
    pending = memoryview(stdin)
    if pending:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE, proc.stdin)
    else:
        proc.stdin.close()
    killed = None
    open_streams = 2
    while open_streams and killed is None:
        left = deadline - time.monotonic()
        if left <= 0:
            killed = "wall time"
            break
        for key, _ in sel.select(timeout=left):
            fd = key.fd
            if key.data is proc.stdin:
                try:
                    pending = pending[os.write(fd, pending[:65536]):]
                except (BrokenPipeError, BlockingIOError) as e:  # the program stopped reading: its business
                    pending = pending[:0] if isinstance(e, BrokenPipeError) else pending
                if not pending:
                    sel.unregister(fd)
                    proc.stdin.close()
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                sel.unregister(fd)
                open_streams -= key.data != "status"
            elif key.data == "status":
                status += chunk
            elif key.data is proc.stdout:
                out += chunk
                if len(out) > limits.max_output_bytes:
                    killed = "output limit"
                    break
            elif len(err) < _STDERR_KEPT:
                err += chunk[:_STDERR_KEPT - len(err)]
    sel.close()
    if killed is None:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # streams closed but the tree lives on (it closed its stdout)
            killed = "wall time"
    if killed is not None:
        _kill_tree(proc, status)
    for f in (proc.stdin, proc.stdout, proc.stderr):
        if not f.closed:
            f.close()
    code = None if killed else proc.returncode
    failed = None  # bwrap reports the program's pid once it has started it: without one it never ran
    if killed is None and _child_pid(status) is None:
        failed = f"bubblewrap exited {code} before starting the program: {bytes(err).decode(errors='replace')[:300]}"
    return RunResult(bytes(out[:limits.max_output_bytes + 1]), bytes(err), code, killed, time.monotonic() - start,
                     failed)


def _kill_tree(proc: subprocess.Popen, status: bytearray) -> None:
    """Kill the sandbox's PID 1 (the kernel then kills every process in its namespace, and bwrap exits once they
    are all gone), then bwrap itself; return when bwrap has exited."""
    init_pid = _child_pid(status)
    if init_pid is not None and proc.poll() is None:
        try:  # a pidfd names this very process, even if its pid were reused meanwhile
            pidfd = os.pidfd_open(init_pid)
        except OSError:
            pidfd = None
        if pidfd is not None:
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(pidfd)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:  # no status yet (killed while starting): bwrap's --die-with-parent child follows it
        proc.kill()
        proc.wait()


def _child_pid(status: bytearray) -> int | None:
    """The host pid of the sandbox's PID 1, from bwrap's first --json-status-fd line."""
    first = bytes(status).split(b"\n", 1)[0]
    try:
        return int(json.loads(first)["child-pid"])
    except (ValueError, KeyError, TypeError):
        return None


@functools.lru_cache(maxsize=None)
def _probe(python: str) -> str | None:
    """None when a sandboxed interpreter starts here, else why not (cached per interpreter)."""
    if shutil.which("bwrap") is None:
        return f"bubblewrap (bwrap) is not installed ({BWRAP_INSTALL})"
    if interpreter(python) is None:
        return (f"the sandbox's interpreter {python!r} is not on this machine (looked on {SYSTEM_PATH}): install "
                f"python3 (apt-get install -y python3) or name one in code.python")
    result = run_python("import sys; print(sys.version_info[0])", limits=Limits(python=python, wall_time_s=20.0))
    if result.exit_code == 0 and result.stdout.strip() == b"3":
        return None
    return (f"bubblewrap could not start a sandbox here (exit {result.exit_code}, {result.killed or 'not killed'}): "
            f"{result.stderr.decode(errors='replace').strip()[:500]}; it needs user, PID and network namespaces "
            f"(a container may have to allow them)")


def check_sandbox(limits: Limits = Limits()) -> None:
    """Raise SandboxUnavailable (saying why and what to do) unless programs can be run sandboxed here."""
    why = _probe(limits.python)
    if why is not None:
        raise SandboxUnavailable(f"code rewards run programs only in a sandbox, and {why}")
