"""Faults of the machine and its stores that a long run meets (a full disk, a damaged file), each told in one line.

A `Fault` is an error whose message is the whole story for a person: what happened, where, and what to do. The
`r1` command prints it as one line instead of a traceback. `disk_fault` recognises a full disk in an error raised
anywhere (torch's writer, SQLite, a Parquet file, a copy): by its errno where the error keeps one, else by the disk
it wrote to having no room left, since torch and SQLite report a full disk in words of their own.
Pure Python: must not depend on torch, Prefect or MLflow.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}  # no room, over a quota, over a file size limit
MIN_FREE = int(float(os.environ.get("R1_MIN_FREE_MB", "64")) * 2**20)  # what a stage needs to start (logs, SQLite)


class Fault(RuntimeError):
    """A fault of the machine or a store, told in the one line its message holds."""


def size_text(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # not reached


def _existing(path: Path) -> Path:
    """`path` or its nearest existing parent: the disk a folder not yet made will be on."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | Path) -> int:
    return shutil.disk_usage(_existing(Path(path))).free


def disk_full_line(path: str | Path, needed: int, free: int) -> str:
    return (f"the disk under {path} is full: {size_text(needed)} needed, {size_text(free)} free. Nothing saved "
            f"was damaged: free some space (or point R1_HOME at a larger disk) and run the same command again to "
            f"resume")


def check_free_space(path: str | Path, needed: int = MIN_FREE) -> None:
    """Raise a `Fault` naming `path` when its disk has less than `needed` bytes free."""
    free = free_bytes(path)
    if free < needed:
        raise Fault(disk_full_line(path, needed, free))


def _chain(e: BaseException | None):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def file_size_limit() -> int | None:
    """This process's file size limit (ulimit -f) in bytes, or None where there is none."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def disk_fault(e: BaseException, paths: list[str | Path], needed: int = MIN_FREE,
               written: str | Path | None = None) -> Fault | None:
    """The `Fault` that `e` is when it comes from a full disk under one of `paths` (or a disk-full errno anywhere in
    its chain, or the file `written`, or a file of the folder `written`, stopped at the process's file size limit),
    else None. `needed` is what the failed write wanted, when known."""
    for link in _chain(e):
        if isinstance(link, Fault):
            return link
    for path in paths:
        free = free_bytes(path)
        if free < needed:
            return Fault(disk_full_line(path, needed, free))
    limit = file_size_limit()
    if limit is not None and written is not None and Path(written).exists():
        files = [Path(written)] if Path(written).is_file() else [p for p in Path(written).rglob("*") if p.is_file()]
        if any(p.stat().st_size >= limit for p in files):
            return Fault(f"writing {written} stopped at this process's file size limit of {size_text(limit)} "
                         f"(ulimit -f). Nothing saved was damaged: raise the limit and run the same command again "
                         f"to resume")
    for link in _chain(e):
        if isinstance(link, OSError) and link.errno in DISK_FULL:
            # a copy (shutil, an artifact upload) names its source first and the file it was writing second
            where = link.filename2 or link.filename or (paths[0] if paths else "a disk")
            what = "a file size limit was reached" if link.errno == errno.EFBIG else os.strerror(link.errno)
            return Fault(f"writing {where} failed: {what}. Nothing saved was damaged: make room and run the same "
                         f"command again to resume")
    return None
