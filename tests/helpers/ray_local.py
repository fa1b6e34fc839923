"""A real Ray cluster on this machine for tests: a head and more nodes, each a `ray start --block` of its own.

Every node gets its own HOME, TMPDIR, R1_HOME, working folder and Ray temp folder, and, where the kernel allows a
private mount namespace (`unshare -m` as root, `unshare -rm` otherwise), the `hide` folders (the driver's) are
covered by an empty read-only tmpfs there: a node reading a driver file by absolute path gets an error.

* Nodes are stopped by their own process groups, never `ray stop` (it kills every Ray process on the machine).
* Everything binds 127.0.0.1: Ray's servers bind loopback only when the node IP is exactly 127.0.0.1, which needs
  RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 on every node and the driver; with it a second node must be started through
  ray_start_loopback.py. Every port Ray would take at a fixed default is chosen free.
* Ray puts unix sockets under --temp-dir and refuses paths over 107 bytes: the root must be short (/tmp/r1ray-*).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from flows.cli.stack import free_port

BIN = Path(sys.executable).parent
HERE = Path(__file__).resolve().parent
PROJECT_ROOT = HERE.parents[1]
CPU_ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")  # torch's, oneDNN's, MKL's


def mount_namespace_prefix() -> list[str] | None:
    """A command prefix that runs its command in a private mount namespace, or None where that is not allowed."""
    unshare = shutil.which("unshare")
    if not unshare or sys.platform != "linux":
        return None
    for prefix in ([unshare, "-m", "--propagation", "private"], [unshare, "-rm", "--propagation", "private"]):
        probe = tempfile.mkdtemp(prefix="r1ns-")
        try:
            if subprocess.run(prefix + ["sh", "-c", f"mount -t tmpfs -o size=4k,ro tmpfs {shlex.quote(probe)}"],
                              capture_output=True, timeout=10).returncode == 0:
                return prefix
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            os.rmdir(probe)
    return None


def pids_mentioning(marker: str) -> list[int]:
    """Processes (other than this one) whose command line holds `marker`."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if marker in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(d.name))
            except OSError:
                pass
    return found


@dataclass
class Node:
    name: str
    root: Path  # home/, tmp/, work/ and the Ray temp folder r/ live here
    proc: subprocess.Popen
    log: Path

    def ready(self) -> bool:
        return "Ray runtime started" in self.log.read_text(errors="replace")


@dataclass
class LocalRayCluster:
    root: Path  # short: Ray's unix sockets live under <root>/<node>/r
    hide: list[Path] = field(default_factory=list)  # folders the nodes must not see
    cpus_per_node: int = 1
    nodes: list[Node] = field(default_factory=list)
    namespace: list[str] | None = None  # the unshare prefix in use; None = same filesystem as the driver
    gcs_port: int = 0
    n_nodes: int = 0  # the head and the nodes that join it

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    def start(self, n_nodes: int = 2) -> "LocalRayCluster":
        """Spawn the head now; `wait_ready` spawns the other nodes once it is up and waits for them."""
        self.namespace = mount_namespace_prefix() if self.hide else None
        self.gcs_port = free_port()
        self.n_nodes = n_nodes
        self._start_node("head")
        return self

    def _start_node(self, name: str) -> None:
        root = self.root / name
        for d in ("home", "tmp", "work"):
            (root / d).mkdir(parents=True, exist_ok=True)
        env = {"PATH": f"{BIN}:/usr/bin:/bin", "LANG": os.environ.get("LANG", "C.UTF-8"), "HOME": str(root / "home"),
               "TMPDIR": str(root / "tmp"), "R1_HOME": str(root / "home" / ".r1"),
               "PREFECT_HOME": str(root / "home" / ".prefect"),
               "PYTHONPATH": str(PROJECT_ROOT),  # stands for the package installed in the nodes' environment
               "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_ENABLE_TELEMETRY": "false",
               "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
               # the CPU kernels the test process was held to (an AVX2-only CPU emulated on a newer one: see
               # docs/benchmarks/test-suite.md), so a node's processes compute as the driver does
               **{k: os.environ[k] for k in CPU_ISA_CAPS if k in os.environ}}
        head = name.startswith("head")
        launcher = [str(BIN / "ray")] if head else [sys.executable, str(HERE / "ray_start_loopback.py")]
        args = [*launcher, "start", "--block", "--node-ip-address=127.0.0.1", f"--num-cpus={self.cpus_per_node}",
                "--num-gpus=0", f"--temp-dir={root / 'r'}", "--object-store-memory=100000000", "--disable-usage-stats",
                *(f"--{flag}={free_port()}" for flag in ("node-manager-port", "object-manager-port",
                                                        "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                                        "runtime-env-agent-port", "metrics-export-port"))]
        if head:
            env["AUTOSCALER_METRIC_PORT"] = str(free_port())  # fixed defaults (44217, 44227) otherwise
            env["DASHBOARD_METRIC_PORT"] = str(free_port())
            args += ["--head", f"--port={self.gcs_port}", f"--ray-client-server-port={free_port()}",
                     "--include-dashboard=false", "--dashboard-host=127.0.0.1"]
        else:
            args += [f"--address={self.address}"]
        if self.namespace:
            mounts = " && ".join(f"mount -t tmpfs -o size=4k,ro,mode=000 tmpfs {shlex.quote(str(h))}"
                                 for h in self.hide)
            args = self.namespace + ["sh", "-c", f"{mounts} && exec {shlex.join(args)}"]
        log = root / "ray-start.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(args, env=env, cwd=root / "work", stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.nodes.append(Node(name, root, proc, log))

    def wait_ready(self, timeout: float = 240) -> "LocalRayCluster":
        """Wait for the head, then start and wait for the other nodes one at a time.

        One at a time, because every node, the head too, gives its raylet a fixed 30 s to register with the GCS
        (Ray's own limit), which a head still starting, on 2 busy cores, can miss; a node that misses it anyway
        (its process exits saying it timed out during startup) is started again, up to twice, in a folder of its
        own; a head started again takes a new GCS port (the nodes are started after it, so they join the new one).
        """
        deadline = time.monotonic() + timeout
        for attempt in range(3):
            if attempt:
                self.gcs_port = free_port()
                self._start_node(f"head{attempt + 1}")
            if self._wait(self.nodes[0], deadline, retry=attempt < 2):
                break
            self._drop_failed()
        for i in range(1, self.n_nodes):
            for attempt in range(3):
                self._start_node(f"n{i}" if not attempt else f"n{i}-{attempt + 1}")
                if self._wait(self.nodes[-1], deadline, retry=attempt < 2):
                    break
                self._drop_failed()
        return self

    def _drop_failed(self) -> None:
        failed = self.nodes.pop()
        try:
            os.killpg(failed.proc.pid, signal.SIGKILL)  # whatever it left running (its own session)
        except ProcessLookupError:
            pass

    def _wait(self, node: Node, deadline: float, retry: bool = False) -> bool:
        """True once `node` is up; False if it gave up on Ray's startup limit and `retry` allows another go."""
        while not node.ready():
            if node.proc.poll() is not None or time.monotonic() > deadline:
                log = node.log.read_text(errors="replace")
                if retry and node.proc.poll() is not None and "timed out during startup" in log:
                    return False
                raise RuntimeError(f"ray node {node.name} did not start:\n{log[-3000:]}")
            time.sleep(0.3)
        return True

    def stop(self) -> list[int]:
        """Stop the nodes (second nodes first) by process group; return the stragglers that had to be killed."""
        for node in reversed(self.nodes):
            if node.proc.poll() is None:
                node.proc.send_signal(signal.SIGTERM)
                try:
                    node.proc.wait(3)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(node.proc.pid, signal.SIGKILL)  # its own session: the group id is its PID
            except ProcessLookupError:
                pass
            node.proc.wait(10)
        stragglers = pids_mentioning(f"{self.root}/")
        for pid in stragglers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return stragglers
