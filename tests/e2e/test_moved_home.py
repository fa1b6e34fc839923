"""An embedded home (R1_HOME) moved or copied to another path goes on where it stopped: its MLflow store, which
records artifact locations as absolute paths, is re-rooted on its first open (runtime/home.py).

A real MLflow store on SQLite with a run and its artifacts, moved and copied for real; then a finished pipeline's
home moved with `mv` (the old path gone) and the next stages run from it with `r1 run --from-run`.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import mlflow
import yaml
from mlflow import MlflowClient

from runtime.home import reroot
from tiny_configs import ALL_STAGES


def embedded_home(home: Path) -> tuple[str, str]:
    """A home as `r1` lays it out: mlflow.db, an experiment whose artifacts are under mlartifacts/, a run with a
    checkpoint artifact and a work folder tag. Returns (experiment id, run id)."""
    (home / "checkpoint").mkdir(parents=True)
    (home / "checkpoint" / "model.safetensors").write_bytes(b"weights")
    c = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    exp = c.create_experiment("r1-pipeline", artifact_location=(home / "mlartifacts").as_uri())
    run = c.create_run(exp, tags={"r1.work_dir.cold_start_sft": str(home / "work" / "cold_start_sft" / "abc")})
    c.log_artifacts(run.info.run_id, str(home / "checkpoint"), "checkpoint")
    c.set_terminated(run.info.run_id)
    shutil.rmtree(home / "checkpoint")
    return exp, run.info.run_id


def fetch(home: Path, run_id: str, dst: Path) -> bytes:
    local = mlflow.artifacts.download_artifacts(artifact_uri=f"runs:/{run_id}/checkpoint", dst_path=str(dst),
                                                tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    return (Path(local) / "model.safetensors").read_bytes()


def test_a_moved_home_is_rerooted_once_and_serves_its_artifacts_from_the_new_path(tmp_path):
    old, new = tmp_path / "old" / "home", tmp_path / "new" / "place"
    exp, run_id = embedded_home(old)
    new.parent.mkdir()
    old.rename(new)  # mv: the old path is gone

    line = reroot(new / "mlflow.db", new)
    assert line == (f"R1_HOME has moved from {old} to {new}: 3 artifact locations and work folders recorded in its "
                    f"MLflow store now point under {new}")  # the experiment, the run, the work folder tag
    c = MlflowClient(tracking_uri=f"sqlite:///{new / 'mlflow.db'}")
    assert c.get_experiment(exp).artifact_location == (new / "mlartifacts").as_uri()
    run = c.get_run(run_id)
    assert run.info.artifact_uri == (new / "mlartifacts" / run_id / "artifacts").as_uri()
    assert run.data.tags["r1.work_dir.cold_start_sft"] == str(new / "work" / "cold_start_sft" / "abc")
    assert fetch(new, run_id, tmp_path / "dl") == b"weights"
    assert reroot(new / "mlflow.db", new) is None  # said once: the store now names its own home
    with sqlite3.connect(new / "mlflow.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_a_copied_home_writes_to_its_own_folder_and_the_original_is_left_as_it_was(tmp_path):
    original, copy = tmp_path / "original", tmp_path / "backup" / "restored home"  # a space: file URIs quote it
    exp, run_id = embedded_home(original)
    shutil.copytree(original, copy)

    assert reroot(copy / "mlflow.db", copy).startswith(f"R1_HOME has moved from {original} to {copy}: 3 ")
    c = MlflowClient(tracking_uri=f"sqlite:///{copy / 'mlflow.db'}")
    assert c.get_experiment(exp).artifact_location == (copy / "mlartifacts").as_uri()
    later = c.create_run(exp)  # a new run of the copy keeps its artifacts in the copy, not in the original
    c.log_text(later.info.run_id, "new", "note.txt")
    assert (copy / "mlartifacts" / later.info.run_id / "artifacts" / "note.txt").read_text() == "new"
    assert not (original / "mlartifacts" / later.info.run_id).exists()
    assert reroot(original / "mlflow.db", original) is None  # the original was not touched
    assert fetch(original, run_id, tmp_path / "a") == fetch(copy, run_id, tmp_path / "b") == b"weights"


def test_a_home_reached_through_a_link_is_not_a_move(tmp_path):
    home = tmp_path / "home"
    embedded_home(home)
    (tmp_path / "link").symlink_to(home)
    assert reroot(tmp_path / "link" / "mlflow.db", tmp_path / "link") is None


def test_a_finished_pipelines_home_moved_elsewhere_feeds_the_next_stages(r1, tmp_path):
    """`r1 run` of the first three stages, the home moved with `mv` (the old path gone), then `r1 run --stages
    sft,alignment_grpo --from-run <that run>` from the new path: the inputs are found and the stages finish."""
    recipe = tmp_path / "moved.yaml"
    recipe.write_text(yaml.safe_dump({**ALL_STAGES, "name": "moved"}))
    first = r1("run", "--recipe", str(recipe), "--stages", "cold_start_sft,reasoning_grpo,rejection_sampling")
    assert first.proc.wait(600) == 0, first.output()[-3000:]
    [pipeline] = [r for r in first.runs() if "stage" not in r.data.tags]

    old, moved = first.home, tmp_path / "elsewhere" / "r1-home"
    moved.parent.mkdir()
    old.rename(moved)
    assert not old.exists()
    from processes import R1

    later = R1(moved, ["run", "--recipe", str(recipe), "--stages", "sft,alignment_grpo",
                       "--from-run", pipeline.info.run_id])
    try:
        assert later.proc.wait(600) == 0, later.output()[-3000:]
    finally:
        later.kill()
    out = later.output()
    assert "Traceback" not in out, out[-3000:]
    assert f"R1_HOME has moved from {old} to {moved}: " in out
    runs = {r.data.tags.get("stage", "pipeline"): r for r in later.runs() if r.info.status == "FINISHED"
            and r.data.tags.get("mlflow.parentRunId", r.info.run_id) != pipeline.info.run_id
            and r.info.run_id != pipeline.info.run_id}
    assert set(runs) == {"pipeline", "sft", "alignment_grpo"}, runs
    assert runs["sft"].data.tags["input.dataset_uri"] == pipeline.data.tags["uri.curated_dataset"]
    for run in runs.values():
        assert run.info.artifact_uri.startswith((moved / "mlartifacts").as_uri())
