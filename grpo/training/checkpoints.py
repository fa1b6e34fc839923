"""Resumable checkpoints of the training loops: `<output_dir>/checkpoints/step-<n>/`, verified before they are trusted.

Every process writes its files of a checkpoint (one Accelerate state, or whatever a distributed strategy writes)
into a hidden folder `.tmp-step-<n>`; once all have, the main process flushes them to disk, writes a manifest (each
file's size and SHA-256) last, and renames the folder to `step-<n>`. A `step-*` folder is therefore whole, whatever
the moment the machine died. A disk error or a copy cut short can still damage one later, so resume
(`load_newest_checkpoint`) checks the newest against its manifest before loading it: a damaged one is named in one
log line and set aside (`damaged-step-<n>`), and the loop resumes from the one before (the newest `keep` stay), or
starts over when none is whole. The same manifest guards any folder on its way through a store (a stage's model or
dataset, a durable copy of a checkpoint): `write_manifest` before it leaves, `verify_manifest` when it comes back.
Each save first checks the disk has room for it, and a disk that fills up during one is named in one line
(`grpo.faults`), the half-written folder removed. A checkpoint also carries the small files of the loop's output
folder that a resumed run must go on with (`CARRIED_FILES`), so they travel with its durable copy. Must not depend
on Prefect or MLflow.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from grpo.faults import check_free_space, disk_fault

if TYPE_CHECKING:  # only named: the manifest helpers serve the `tasks` layer without loading torch
    from accelerate import Accelerator

# {"files": {relative path: {"size": bytes, "sha256": hex}}}, written last; hidden, so readers of a whole folder
# (pyarrow's datasets, Hugging Face datasets) pass it by
MANIFEST = ".manifest.json"
NO_MANIFEST = f"it has no {MANIFEST} (it was never finished, or was copied without it)"
# files of `<output_dir>` copied into each of its checkpoints: the fp32 GEMM plan (grpo.kernels.gemm.PLAN_FILE),
# which a run resumed from a durable copy on a fresh disk keeps, to resume to the bit
CARRIED_FILES = ("gemm.json",)
log = logging.getLogger(__name__)


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    """Flush a file (or a folder's entries) to the disk: a rename must never reach it before the data does."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in (MANIFEST, f"{MANIFEST}.part"))


def write_manifest(folder: str | Path) -> None:
    """Flush every file under `folder` to disk, then record its size and checksum in `folder/.manifest.json`."""
    folder = Path(folder)
    files = {}
    for p in _files(folder):
        _fsync(p)
        files[p.relative_to(folder).as_posix()] = {"size": p.stat().st_size, "sha256": _digest(p)}
    part = folder / f"{MANIFEST}.part"
    with open(part, "w") as f:
        json.dump({"files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, folder / MANIFEST)
    _fsync(folder)


def verify_manifest(folder: str | Path, *, checksums: bool = True) -> str | None:
    """What is wrong with `folder` measured against its manifest, in words; None when every file is whole.
    Without `checksums` only presence and sizes are compared (cheap: no file is read)."""
    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        return NO_MANIFEST
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
        wanted = {rel: (int(f["size"]), str(f["sha256"])) for rel, f in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"its {MANIFEST} is not readable"
    for rel, (size, _) in wanted.items():
        p = folder / rel
        if not p.is_file():
            return f"{rel} is missing"
        if p.stat().st_size != size:
            return f"{rel} has {p.stat().st_size} bytes where its manifest says {size} (cut short)"
    if checksums:
        for rel, (_, sha) in wanted.items():
            if _digest(folder / rel) != sha:
                return f"{rel} does not match its checksum (damaged)"
    return None


def _step_of(path: Path) -> int:
    return int(path.name.split("-")[1])


def _step_folders(root: Path) -> list[Path]:
    """`step-<n>` folders under `root`, newest first."""
    found = [p for p in Path(root).glob("step-*") if p.is_dir() and p.name.split("-")[1].isdigit()]
    return sorted(found, key=_step_of, reverse=True)


def latest_checkpoint(root: Path) -> Path | None:
    """The newest finished checkpoint under `root` (its manifest written), or None; nothing is read but names.
    Loops resume through `load_newest_checkpoint`, which verifies first."""
    return next((p for p in _step_folders(root) if (p / MANIFEST).is_file()), None)


def checkpoint_step(path: Path) -> int:
    return json.loads((path / "trainer_state.json").read_text())["step"]


def resumable_step(output_dir: str | Path) -> int:
    """The step a loop writing to `output_dir` would resume from (0: it starts over)."""
    latest = latest_checkpoint(Path(output_dir) / "checkpoints")
    return checkpoint_step(latest) if latest is not None else 0


def newest_verified_checkpoint(root: Path) -> Path | None:
    """The newest checkpoint under `root` whose files match its manifest, or None. Each one found damaged on the
    way is named in one log line and set aside as `damaged-step-<n>`, so no later look takes it."""
    damaged, good = [], None
    for path in _step_folders(root):
        problem = verify_manifest(path)
        if problem is None:
            good = path
            break
        aside = path.with_name(f"damaged-{path.name}")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(path, aside)
        damaged.append((path, problem, aside))
    then = f"resuming from {good.name}" if good is not None else "no earlier one is left: starting over"
    for path, problem, aside in damaged:
        log.warning("checkpoint %s is damaged: %s; set aside as %s, %s", path, problem, aside.name, then)
    return good


def load_newest_checkpoint(acc: Accelerator, root: Path, load_state: Callable[[str], None] | None = None) -> int:
    """Load the newest whole checkpoint under `root` into the prepared model, optimizer, scheduler and RNG (with
    `load_state(folder)`, by default the accelerator's); the step it holds, or 0 when there is none to trust."""
    if acc.is_main_process:  # one process judges (and sets aside), so every process loads the same one
        newest_verified_checkpoint(root)
    acc.wait_for_everyone()
    path = latest_checkpoint(root)
    if path is None:
        return 0
    (load_state or acc.load_state)(str(path))
    return checkpoint_step(path)


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def checkpoint_bytes(acc: Accelerator, root: Path) -> int:
    """What the next checkpoint under `root` will take on disk: the size of the newest one, or before the first
    the bytes of the prepared models' weights and optimizers' state (with a margin for pickling and RNG files)."""
    latest = latest_checkpoint(root)
    if latest is not None:
        return _folder_bytes(latest)
    tensors = [t for m in acc._models for t in m.state_dict().values()]
    for o in acc._optimizers:  # their live state, not `state_dict()`, which may copy (MasterWeights' masters)
        inner = getattr(o, "optimizer", o)  # inside accelerate's wrapper
        tensors += [*_tensors(list(inner.state.values())), *getattr(inner, "masters", [])]
    return int(sum(t.numel() * t.element_size() for t in _tensors(tensors)) * 1.1) + 2**20


def _tensors(obj):
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def save_checkpoint(acc: Accelerator, root: Path, step: int, keep: int,
                    save_state: Callable[[str], None] | None = None) -> None:
    """Model, optimizer, scheduler and RNG state at `step` (written by `save_state(folder)` on every process, by
    default the accelerator's), verified by a manifest and renamed into place; only the newest `keep` stay.

    A disk without room for it raises a `Fault` naming the folder, what it needs and what is free: before writing
    when the room is not there, or when a write runs out of it (another process filled the disk meanwhile), the
    partial folder then removed. The checkpoints already there are never touched on the way."""
    path, tmp = root / f"step-{step}", root / f".tmp-step-{step}"
    needed = checkpoint_bytes(acc, root)
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # one a dead process left half-written
    check_free_space(root, needed)  # on every process: all stop here together, none waits at a barrier for one
    if acc.is_main_process:
        tmp.mkdir(parents=True)
    acc.wait_for_everyone()
    try:
        if save_state is None:
            acc.save_state(str(tmp), safe_serialization=False)  # tied embeddings trip safetensors' shared-memory check
        else:
            save_state(str(tmp))
        acc.wait_for_everyone()  # the manifest goes in once every process has written its part
        if acc.is_main_process:
            (tmp / "trainer_state.json").write_text(json.dumps({"step": step}))
            for name in CARRIED_FILES:
                if (root.parent / name).is_file():
                    shutil.copyfile(root.parent / name, tmp / name)
            write_manifest(tmp)  # flushes every file first, then the manifest, last
    except Exception as e:
        # judged before the partial files are removed: torch reports a full disk in words of its own, so the
        # disk's free space (none left) is what tells it
        fault = disk_fault(e, [root], needed, written=tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if fault is not None:
            raise fault from e
        raise
    if acc.is_main_process:
        shutil.rmtree(path, ignore_errors=True)  # the same step written before (a resume from an earlier one)
        os.replace(tmp, path)
        _fsync(root)  # the rename itself reaches the disk
        for old in _step_folders(root)[keep:]:
            shutil.rmtree(old, ignore_errors=True)
        for damaged in root.glob("damaged-step-*"):  # kept for a look until a newer whole one exists
            shutil.rmtree(damaged, ignore_errors=True)
    acc.wait_for_everyone()
