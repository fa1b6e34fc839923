"""Resume checkpoints that outlive the machine: copies of a training loop's checkpoints in the MLflow artifact store.

A training loop writes its resume checkpoints (weights, optimizer, scheduler, RNG, step; grpo/training/checkpoints.py)
into its work folder on the local disk, which a preempted pod or a lost node takes with it. While the loop trains,
`durable_resume` copies each complete checkpoint to the stage run's artifacts (`resume/<work key>/step-<n>/`) and
only then tags the run `r1.resume.<work key>` with the step: the tag is the mark, so a copy cut off half-way is
never taken. A stage that starts on a machine that has never seen its work folder finds the newest marked copy among
all runs with the same work key (the same config and inputs) and downloads it into the folder before the loop
starts, which then resumes from it as from its own. The local folder is only a cache. Every copy carries the
checkpoint's manifest and is checked against it on both sides: a damaged local checkpoint is never uploaded, and a
download that does not match (a store that lost or cut a file) is named in one log line and not taken.

Only the newest copy of a work key is kept: marking one deletes the older ones (of this run and of the runs it
resumed from), and a stage that finishes deletes its own, as a finished stage is reused, never resumed.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from grpo.training.checkpoints import checkpoint_step, latest_checkpoint, newest_verified_checkpoint, verify_manifest
from runtime import tracking

PREFIX = "r1.resume."  # tag `r1.resume.<work key>` = the step of the run's newest complete copy
EVERY_S = float(os.environ.get("R1_DURABLE_EVERY_S", "2"))  # how often the folder is looked at for a new checkpoint
log = logging.getLogger(__name__)


def _tag(key: str) -> str:
    return PREFIX + key


def _artifact_path(key: str, step: int) -> str:
    return f"resume/{key}/step-{step}"


def marked_copies(key: str) -> list[tuple[str, int]]:
    """(run id, step) of every run holding a marked copy of work key `key`."""
    runs = tracking.find_runs(f"tags.`{_tag(key)}` LIKE '%'")
    return [(r.info.run_id, int(r.data.tags[_tag(key)])) for r in runs if r.data.tags.get(_tag(key), "").isdigit()]


def newest_copy(key: str, exclude: str | None = None) -> tuple[str, int] | None:
    """(run id, step) of the newest marked copy of work key `key` in any run (but `exclude`), or None."""
    return max(((r, s) for r, s in marked_copies(key) if r != exclude), key=lambda f: f[1], default=None)


def _delete_copy(run_id: str, key: str, step: int | None = None) -> None:
    """Delete a run's copy (or all its copies) of `key`, best effort: a store that cannot delete keeps them."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    run = tracking.client().get_run(run_id)
    path = _artifact_path(key, step) if step is not None else f"resume/{key}"
    try:
        get_artifact_repository(run.info.artifact_uri).delete_artifacts(path)
    except Exception as e:  # noqa: BLE001 (any store's error: pruning must never fail a stage)
        log.warning("could not delete %s of run %s: %s", path, run_id, e)
    if step is None or run.data.tags.get(_tag(key)) == str(step):
        try:
            tracking.client().delete_tag(run_id, _tag(key))
        except Exception as e:
            # two pipelines that resumed the same work at once both finish it: the second finds the mark gone
            if getattr(e, "error_code", None) != "RESOURCE_DOES_NOT_EXIST":
                raise


def restore(run_id: str, out: Path) -> int:
    """Download the newest marked copy of `out`'s work into `out/checkpoints` when the folder has no checkpoint of
    its own (or an older one); returns the step it holds (0: none anywhere)."""
    from runtime.stage import FRESH

    key = out.name.split("-")[0]  # a private folder is `<key>-<run id>`
    if tracking.client().get_run(run_id).data.tags.get(FRESH) == "true":  # starts over: takes no one's work
        return 0
    local = newest_verified_checkpoint(out / "checkpoints")  # a damaged one is set aside (and named) here
    local_step = checkpoint_step(local) if local is not None else 0
    newest = newest_copy(key, exclude=run_id)
    if newest is None or newest[1] <= local_step:
        return local_step
    source, step = newest
    target = out / "checkpoints" / f"step-{step}"
    staging = out / "checkpoints" / f".download-{step}"  # no `step-*` name until whole: a partial one is not taken
    shutil.rmtree(staging, ignore_errors=True)
    staging.parent.mkdir(parents=True, exist_ok=True)
    tracking.client().download_artifacts(source, _artifact_path(key, step), str(staging))
    downloaded = staging / f"step-{step}"
    problem = verify_manifest(downloaded)
    if problem is not None:
        shutil.rmtree(staging, ignore_errors=True)
        then = f"resuming from local step {local_step}" if local_step else "the stage starts over"
        log.warning("the durable copy of step %d in run %s is damaged: %s; %s", step, source, problem, then)
        return local_step
    shutil.rmtree(target, ignore_errors=True)
    os.replace(downloaded, target)
    shutil.rmtree(staging, ignore_errors=True)
    tracking.set_tags(run_id, {"r1.resumed_from_run": source})
    return step


def check_writable(run_id: str) -> None:
    """The run's artifact store takes a write from here, before any training: a loop whose checkpoints cannot be
    kept would lose everything with its machine."""
    try:
        tracking.client().log_text(run_id, "resume checkpoints of this run are written here\n", "resume/README.txt")
    except Exception as e:  # noqa: BLE001 (whatever the store raises: permissions, a bucket, a server away)
        uri = tracking.client().get_run(run_id).info.artifact_uri
        raise RuntimeError(f"the MLflow artifact store {uri} does not take a write from this machine ({e}); resume "
                           "checkpoints could not outlive it: fix its permissions or MLFLOW_TRACKING_URI") from e


class _Uploader(threading.Thread):
    """Copies each new complete checkpoint of the folder to the run's artifacts, then marks it."""

    def __init__(self, run_id: str, out: Path, after_step: int):
        super().__init__(name=f"durable-{out.name}", daemon=True)
        self.run_id, self.out, self.key = run_id, out, out.name.split("-")[0]
        self.done_step = after_step  # what the store already holds for this folder
        self.stop = threading.Event()

    def run(self) -> None:
        failing = False
        while not self.stop.wait(EVERY_S):
            try:
                self.sync()
                failing = False
            except Exception as e:  # noqa: BLE001 (a store away for a while: the copy is tried again, said once)
                if not failing:
                    log.warning("resume checkpoint not copied to the durable store yet (%s); trying again every "
                                "%.0f s", " ".join(str(e).split())[:200], EVERY_S)
                failing = True

    def sync(self) -> None:
        latest = latest_checkpoint(self.out / "checkpoints")
        if latest is None or checkpoint_step(latest) <= self.done_step:
            return
        step = checkpoint_step(latest)
        staging = self.out / "durable" / f"step-{step}"  # hard links: the loop may delete its checkpoint meanwhile
        shutil.rmtree(staging, ignore_errors=True)
        try:
            shutil.copytree(latest, staging, copy_function=os.link)
        except (OSError, shutil.Error):  # deleted under us by the loop's own pruning: the next one will do
            shutil.rmtree(staging, ignore_errors=True)
            return
        problem = verify_manifest(staging)  # the same files as the loop's (hard links): damaged there, not copied
        if problem is not None:
            shutil.rmtree(staging, ignore_errors=True)
            log.warning("checkpoint %s is damaged (%s): not copied to the durable store", latest, problem)
            self.done_step = step  # named once; the next checkpoint is copied as usual
            return
        before = marked_copies(self.key)
        try:
            tracking.client().log_artifacts(self.run_id, str(staging), _artifact_path(self.key, step))
            # the mark, once the copy is whole
            tracking.set_tags(self.run_id, {_tag(self.key): str(step)})
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        log.info("resume checkpoint at step %d copied to run %s", step, self.run_id)
        for run, old in before:  # the copies it replaces: this run's older one, those of runs it resumed from
            if old != step or run != self.run_id:
                _delete_copy(run, self.key, old)
        self.done_step = step


@contextmanager
def durable_resume(run_id: str, out: Path) -> Iterator[int]:
    """Around a training loop writing to `out`: restore its newest durable checkpoint first (yields the step it
    resumes from, 0 for none) and copy each new one to the store while it trains. Tags `r1.resumed_from_step`."""
    check_writable(run_id)
    step = restore(run_id, out)
    if step:
        tracking.set_tags(run_id, {"r1.resumed_from_step": str(step)})
    uploader = _Uploader(run_id, out, after_step=step)
    uploader.start()
    try:
        yield step
    except BaseException:
        uploader.stop.set()  # not joined: a stop must not wait for an upload; an unmarked copy is never taken
        raise
    uploader.stop.set()
    uploader.join()
    key = out.name.split("-")[0]
    for run, _ in marked_copies(key):  # finished: reused from now on, never resumed
        _delete_copy(run, key)
