"""Durable resume checkpoints (runtime/durable.py) against a real MLflow store: copied, marked, found, pruned; a copy
cut off before its mark is never taken; a store that takes no write fails before any training."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from grpo.training.checkpoints import write_manifest
from runtime import tracking
from runtime.durable import _Uploader, check_writable, durable_resume, marked_copies, restore


def checkpoint(out: Path, step: int, payload: bytes) -> Path:
    """A complete checkpoint as the loops write one: its files, then the manifest last."""
    path = out / "checkpoints" / f"step-{step}"
    path.mkdir(parents=True)
    (path / "model.bin").write_bytes(payload)
    (path / "trainer_state.json").write_text(json.dumps({"step": step}))
    write_manifest(path)
    return path


@pytest.fixture
def key(tmp_path) -> str:
    return f"k{os.getpid()}{abs(hash(str(tmp_path))) % 10**8}"  # a work key of this test alone


def test_a_marked_copy_is_restored_on_a_disk_that_never_saw_it_and_older_ones_are_pruned(tmp_path, key):
    first = tracking.start_run("first", tags={})
    out = tmp_path / "a" / key
    uploader = _Uploader(first, out, after_step=0)
    checkpoint(out, 2, b"two")
    uploader.sync()
    checkpoint(out, 4, b"four")
    uploader.sync()
    assert marked_copies(key) == [(first, 4)]
    assert [f.path for f in tracking.client().list_artifacts(first, f"resume/{key}")] == [f"resume/{key}/step-4"]
    tracking.end_run(first, "FAILED")

    second = tracking.start_run("second", tags={})  # another machine: an empty folder of the same key
    fresh = tmp_path / "b" / key
    fresh.mkdir(parents=True)
    assert restore(second, fresh) == 4
    assert (fresh / "checkpoints" / "step-4" / "model.bin").read_bytes() == b"four"
    assert tracking.client().get_run(second).data.tags["r1.resumed_from_run"] == first
    tracking.end_run(second)


def test_a_copy_cut_off_before_its_mark_is_never_taken(tmp_path, key):
    run = tracking.start_run("cut", tags={})
    out = tmp_path / "a" / key
    uploader = _Uploader(run, out, after_step=0)
    checkpoint(out, 2, b"two")
    uploader.sync()
    # the process dies while copying step 4: its files reached the store, its mark did not
    partial = checkpoint(tmp_path / "partial", 4, b"fou")
    tracking.client().log_artifacts(run, str(partial), f"resume/{key}/step-4")
    tracking.end_run(run, "FAILED")

    other = tracking.start_run("other", tags={})
    fresh = tmp_path / "b" / key
    (fresh / "checkpoints" / ".download-4").mkdir(parents=True)  # and a download cut off on this disk
    assert restore(other, fresh) == 2
    assert sorted(p.name for p in (fresh / "checkpoints").glob("step-*")) == ["step-2"]
    tracking.end_run(other)


def test_a_finished_loop_keeps_no_copy_and_a_fresh_run_takes_none(tmp_path, key):
    from runtime.stage import FRESH

    earlier = tracking.start_run("earlier", tags={})
    out = tmp_path / "a" / key
    checkpoint(out, 2, b"two")
    _Uploader(earlier, out, after_step=0).sync()
    tracking.end_run(earlier, "FAILED")

    fresh_run = tracking.start_run("fresh", tags={FRESH: "true"})
    assert restore(fresh_run, tmp_path / "b" / key) == 0
    tracking.end_run(fresh_run)

    run = tracking.start_run("finishing", tags={})
    shutil.rmtree(out)
    with durable_resume(run, out) as step:
        assert step == 2
    assert marked_copies(key) == []  # a finished stage is reused from now on, never resumed
    tracking.end_run(run)


def test_a_store_that_takes_no_write_fails_before_training(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("R1_EXPERIMENT", "unwritable")
    tracking.client().create_experiment("unwritable", artifact_location="/proc/r1-no-such-store")
    run = tracking.start_run("unwritable", tags={})
    with pytest.raises(RuntimeError, match="does not take a write from this machine"):
        check_writable(run)
    tracking.end_run(run, "FAILED")


def test_a_damaged_durable_copy_is_named_and_not_taken(tmp_path, key, caplog):
    run = tracking.start_run("damaged-copy", tags={})
    out = tmp_path / "a" / key
    checkpoint(out, 2, b"two")
    _Uploader(run, out, after_step=0).sync()
    # the store lost half a file of the copy it holds (the mark stays): written over, cut short
    cut = checkpoint(tmp_path / "cut" / key, 2, b"two")
    (cut / "model.bin").write_bytes(b"tw")
    tracking.client().log_artifact(run, str(cut / "model.bin"), f"resume/{key}/step-2")
    tracking.end_run(run, "FAILED")

    other = tracking.start_run("other", tags={})
    fresh = tmp_path / "b" / key
    fresh.mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger="runtime.durable"):
        assert restore(other, fresh) == 0  # nothing to trust anywhere: the stage starts over
    assert [r.getMessage() for r in caplog.records if r.name == "runtime.durable"] == [
        f"the durable copy of step 2 in run {run} is damaged: model.bin has 2 bytes where its manifest says 3 (cut "
        "short); the stage starts over"]
    assert not list((fresh / "checkpoints").glob("step-*"))
    tracking.end_run(other)


def test_a_damaged_local_checkpoint_is_not_copied_to_the_store(tmp_path, key, caplog):
    run = tracking.start_run("damaged-local", tags={})
    out = tmp_path / "a" / key
    uploader = _Uploader(run, out, after_step=0)
    checkpoint(out, 2, b"two")
    uploader.sync()
    (checkpoint(out, 4, b"four") / "model.bin").write_bytes(b"fo")  # cut short on the disk after it was written
    with caplog.at_level(logging.WARNING, logger="runtime.durable"):
        uploader.sync()
        uploader.sync()  # named once
    assert len([r for r in caplog.records if "step-4 is damaged" in r.getMessage()]) == 1
    assert marked_copies(key) == [(run, 2)]  # the store keeps the whole one
    tracking.end_run(run, "FAILED")


def test_a_stage_output_cut_short_in_the_store_is_one_line_and_a_cut_local_copy_is_fetched_again(tmp_path):
    from urllib.parse import urlparse

    from grpo.faults import Fault

    run = tracking.start_run("outputs", tags={})
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"w" * 1000)
    (model / "config.json").write_text("{}")
    uri = tracking.log_dir(run, model, "checkpoint")
    tracking.end_run(run)

    local = tracking.download(uri)
    assert (local / "model.safetensors").read_bytes() == b"w" * 1000
    (local / "model.safetensors").write_bytes(b"w" * 10)  # the cached copy cut short on this disk
    assert (tracking.download(uri) / "model.safetensors").read_bytes() == b"w" * 1000  # fetched again, whole

    # the store itself lost the end of the weights
    stored = Path(urlparse(tracking.client().get_run(run).info.artifact_uri).path) / "checkpoint" / "model.safetensors"
    stored.write_bytes(b"w" * 500)
    shutil.rmtree(local.parent)  # as on a machine that never fetched it
    with pytest.raises(Fault, match=rf"^{uri} is damaged: model.safetensors has 500 bytes where its manifest says "
                                    r"1000 \(cut short\); .* must run again"):
        tracking.download(uri)
    with pytest.raises(Fault, match="is damaged"):
        tracking.download(uri, tmp_path / "elsewhere")


def test_two_runs_that_finish_the_same_work_both_delete_its_copy(tmp_path, key):
    # two pipelines that resumed one stage's work at once both finish it, and each deletes the copy it resumed
    # from: the second finds the mark already gone, which is what it wanted (it failed the second run)
    from runtime.durable import _delete_copy

    run = tracking.start_run("copied", tags={})
    out = tmp_path / "a" / key
    uploader = _Uploader(run, out, after_step=0)
    checkpoint(out, 2, b"two")
    uploader.sync()
    assert marked_copies(key) == [(run, 2)]
    _delete_copy(run, key)
    _delete_copy(run, key)  # the other pipeline, a moment later
    assert marked_copies(key) == []
    tracking.end_run(run)
