"""A small disk of its own (a tmpfs, mounted where the test may: as root) and another job filling it up."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path


def mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def fill(disk: Path, leave: int) -> Path:
    """Another job's file, taking all of the disk's free space but `leave` bytes."""
    from grpo.faults import free_bytes

    filler = disk / f"other-job-{uuid.uuid4().hex}"
    with open(filler, "wb", buffering=0) as f:
        while (room := free_bytes(disk) - leave) > 0:
            try:
                f.write(b"\0" * min(room, 1 << 20))
            except OSError:  # a run writing to the disk meanwhile took the rest: give `leave` back
                f.truncate(max(os.fstat(f.fileno()).st_size - leave, 0))
                break
    return filler
