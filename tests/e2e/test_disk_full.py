"""A full disk is named, and nothing saved is damaged: the faults made for real on a small tmpfs (mounted where the
test may: as root) and with a low file size limit (RLIMIT_FSIZE, anywhere).

The SFT loop trains with checkpoints every two steps; after step 2 is saved, the disk is filled (as another job on
a shared disk would), so the step-4 save finds no room: one `Fault` line naming the folder, what it needs and what is
free; step 2 is intact, no half-written folder is left, and once the disk has room the same loop resumes from step 2
to the weights of a run that never met the fault.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from disks import fill, mount_tmpfs
from grpo.configs.training import SFTConfig
from grpo.faults import Fault, size_text
from grpo.models import load_model_and_tokenizer
from grpo.training.checkpoints import latest_checkpoint, save_checkpoint, verify_manifest
from grpo.training.loops.sft_trainer import train_sft
from tiny_configs import SMALL

ROWS = pd.DataFrame({"prompt": [f"What is {i} + 1?" for i in range(16)],
                     "response": [f"<think>{i} + 1 = {i + 1}.</think><answer>{i + 1}</answer>" for i in range(16)]})
SFT = SFTConfig(max_steps=6, batch_size=4, learning_rate=3e-3, warmup_steps=1, log_every=1, checkpoint_every=2,
                mixed_precision="no")


@pytest.fixture
def small_disk(tmp_path):
    """A 32 MiB disk of its own, or a skip saying why there is none (the file size limit test runs anywhere)."""
    disk = tmp_path / "disk"
    if not mount_tmpfs(disk, "32m"):
        pytest.skip("mounting a tmpfs needs root: the file size limit test below makes the fault instead")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def test_no_room_for_the_next_checkpoint_is_one_line_and_the_same_loop_resumes_once_there_is(small_disk, tmp_path):
    model, tok = load_model_and_tokenizer(SMALL)
    straight = train_sft(model, tok, ROWS, SFT, tmp_path / "straight", progress=False)
    filler = []

    def fill_after_step_2(step, _):
        if step == 3:
            filler.append(fill(small_disk, leave=64 * 1024))

    out = small_disk / "sft"
    model, tok = load_model_and_tokenizer(SMALL)
    with pytest.raises(Fault) as e:
        train_sft(model, tok, ROWS, SFT, out, fill_after_step_2, progress=False)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"the disk under {out / 'checkpoints'} is full: ")
    assert "needed, 64.0 KiB free" in line and "run the same command again to resume" in line
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-2"] and verify_manifest(ckpts / "step-2") is None

    filler[0].unlink()  # room again
    steps = []
    model, tok = load_model_and_tokenizer(SMALL)
    resumed = train_sft(model, tok, ROWS, SFT, out, lambda s, _: steps.append(s), progress=False)
    assert steps == [3, 4, 5, 6]
    a = AutoModelForCausalLM.from_pretrained(straight.model_dir).state_dict()
    b = AutoModelForCausalLM.from_pretrained(resumed.model_dir).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_disk_that_fills_up_during_a_save_is_one_line_and_the_partial_folder_goes(small_disk):
    from grpo.training.accelerator import make_accelerator
    from grpo.training.optimizers import make_adamw

    model, _ = load_model_and_tokenizer(SMALL)
    acc = make_accelerator("no", 1)
    model, optimizer = acc.prepare(model, make_adamw(model, 1e-3, 0.0))
    root = small_disk / "checkpoints"
    save_checkpoint(acc, root, 2, keep=2)

    def filled_meanwhile(folder: str) -> None:  # the room was there when checked; another job took it since
        fill(small_disk, leave=4096)
        acc.save_state(folder, safe_serialization=False)

    with pytest.raises(Fault, match=rf"^the disk under {root} is full: .* needed, [0-9.]+ (B|KiB) free\. Nothing "
                                    r"saved was damaged"):
        save_checkpoint(acc, root, 4, keep=2, save_state=filled_meanwhile)
    assert sorted(p.name for p in root.iterdir()) == ["step-2"]  # the partial step 4 is gone, step 2 untouched
    assert latest_checkpoint(root).name == "step-2" and verify_manifest(root / "step-2") is None


SAVE_UNDER_A_FILE_SIZE_LIMIT = """
import resource, signal, sys
from grpo.configs.model import ModelConfig, TinyModelConfig
from grpo.faults import Fault
from grpo.models import load_model_and_tokenizer
from grpo.training.accelerator import make_accelerator
from grpo.training.checkpoints import save_checkpoint
from grpo.training.optimizers import make_adamw

model, _ = load_model_and_tokenizer(ModelConfig(tiny=TinyModelConfig(hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)))
acc = make_accelerator("no", 1)
model, optimizer = acc.prepare(model, make_adamw(model, 1e-3, 0.0))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write over the limit then fails (EFBIG) instead of killing us
if sys.argv[2] != "unlimited":
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.RLIM_INFINITY))
try:
    print("SAVED", save_checkpoint(acc, __import__("pathlib").Path(sys.argv[1]), 2, keep=2))
except Fault as e:
    print("FAULT", e)
"""


def test_a_file_size_limit_met_during_a_save_is_one_line_and_raising_it_is_enough(tmp_path):
    root = tmp_path / "checkpoints"

    def save(limit: str) -> str:
        out = subprocess.run([sys.executable, "-c", SAVE_UNDER_A_FILE_SIZE_LIMIT, str(root), limit],
                             capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout + out.stderr[-2000:]

    out = save(str(256 * 1024))
    assert out.startswith(f"FAULT writing {root / '.tmp-step-2'} stopped at this process's file size limit "
                          "of 256.0 KiB (ulimit -f). Nothing saved was damaged: raise the limit and run the same "
                          "command again to resume"), out
    assert not list(root.iterdir())  # nothing half-written left
    assert save("unlimited").startswith("SAVED")  # the advice, followed: the limit raised, the same save again
    assert verify_manifest(root / "step-2") is None


def test_a_stage_on_a_full_disk_ends_failed_with_one_line_and_the_same_command_resumes(r1, tmp_path):
    """`r1 run` with its work folders on a small disk of their own (MLflow and Prefect beside them on the big one),
    filled by another job once the stage has written its first checkpoint."""
    from grpo.training.checkpoints import resumable_step
    from runs import stage_run
    from tiny_configs import TINY_STAGE

    work = tmp_path / "home" / "work"
    if not mount_tmpfs(work, "160m"):  # room for a stage to start (grpo.faults.MIN_FREE)
        pytest.skip("mounting a tmpfs needs root")
    try:
        cold = {**TINY_STAGE, "data": {"num_train": 64, "num_heldout": 0},
                "train": {**TINY_STAGE["train"], "max_steps": 80, "checkpoint_every": 4, "mixed_precision": "no"}}
        recipe = tmp_path / "disk.yaml"
        recipe.write_text(yaml.safe_dump({"name": "disk-full", "cold_start_sft": cold}))
        args = ["run", "--recipe", str(recipe), "--stages", "cold_start_sft"]
        run = r1(*args)
        folder = run.wait_for("cold-start training", lambda: (r := stage_run(run, "cold_start_sft")) and
                              r.data.tags.get("r1.work_dir.cold_start_sft"))
        run.wait_for("a checkpoint", lambda: resumable_step(Path(folder)))
        filler = fill(work, leave=64 * 1024)
        assert run.proc.wait(120) == 1, run.output()[-3000:]
        out = run.output()
        assert "Traceback" not in out, out[-3000:]
        lines = [line for line in out.splitlines() if line.startswith("r1:")]
        assert len(lines) == 1 and lines[0].startswith(f"r1: the disk under {folder}/checkpoints is full: "), \
            out[-3000:]
        assert {r.data.tags.get("stage", "pipeline"): r.info.status for r in run.runs()} == {
            "pipeline": "FAILED", "cold_start_sft": "FAILED"}
        step = resumable_step(Path(folder))
        assert step >= 4 and verify_manifest(latest_checkpoint(Path(folder) / "checkpoints")) is None

        filler.unlink()  # room again
        again = r1(*args)
        assert again.proc.wait(300) == 0, again.output()[-3000:]
        resumed = next(r for r in again.runs() if r.data.tags.get("stage") == "cold_start_sft"
                       and r.info.status == "FINISHED")
        assert int(resumed.data.tags["r1.resumed_from_step"]) == step
    finally:
        subprocess.run(["umount", "-l", str(work)], check=False)


def test_a_disk_that_fills_mid_grpo_under_the_embedded_store_is_one_line_and_a_copy_of_the_home_resumes(
        prefect_harness, tmp_path, one_thread_everywhere):
    """`r1 run` with R1_HOME on a small disk that another job fills once reasoning GRPO has written a checkpoint:
    whichever write meets it first (MLflow's SQLite, Prefect's results, a checkpoint), one line and no traceback.
    The home, copied as it was to a roomy folder at another path, then resumes GRPO under the same command and ends
    with the weights of a run that never met the fault.

    Where no tmpfs can be mounted (not root, or R1_TEST_NO_MOUNT=1 to try it), the `r1` process is given a file size
    limit instead (prlimit), at the size MLflow's SQLite file has then, so its next page is refused."""
    import shutil
    import sqlite3

    from safetensors.torch import load_file


    from flows.reasoning_grpo import reasoning_grpo
    from grpo.configs.recipe import ReasoningGRPOConfig
    from grpo.training.checkpoints import resumable_step
    from processes import R1, frozen_code
    from runs import stage_run
    from tiny_configs import TINY_GRPO, TINY_STAGE

    import resource

    # both commands run the code as it is now: "the same command" is the same code (the reuse key digests it), were
    # the checkout edited meanwhile
    code = frozen_code(tmp_path / "code")
    disk = tmp_path / "disk"
    # room for each stage to start (grpo.faults.MIN_FREE), little more
    mounted = os.environ.get("R1_TEST_NO_MOUNT") != "1" and mount_tmpfs(disk, "100m")
    disk.mkdir(exist_ok=True)
    runs = []
    try:
        # fp32 on MKL's GEMMs, as the resume tests pin: the resumed and the reference run must round alike
        # a cold start that writes the format about half the time, so GRPO's groups differ and it has something to
        # learn (as in tests/e2e/test_pipeline_resume.py)
        cold = {**TINY_STAGE, "data": {"num_train": 64, "num_heldout": 0},
                "train": {**TINY_STAGE["train"], "seed": 46, "max_steps": 100, "learning_rate": 1e-2,
                          "warmup_steps": 0, "fp32_gemm": "mkl"}}
        grpo = {**TINY_GRPO, "data": {"num_train": 32, "num_heldout": 0},
                "grpo": {**TINY_GRPO["grpo"], "max_steps": 12, "checkpoint_every": 2, "seed": 46, "fp32_gemm": "mkl",
                         "sampling": {"max_new_tokens": 48}}}
        recipe = tmp_path / "fills.yaml"
        recipe.write_text(yaml.safe_dump({"name": "disk-fills", "cold_start_sft": cold, "reasoning_grpo": grpo}))
        args = ["run", "--recipe", str(recipe), "--stages", "cold_start_sft,reasoning_grpo"]
        home = disk / "home"
        runs.append(run := R1(home, args, log_dir=tmp_path, code=code))  # its terminal on another disk
        folder = Path(run.wait_for("reasoning GRPO", lambda: (r := stage_run(run, "reasoning_grpo")) and
                                   r.data.tags.get("r1.work_dir.reasoning_grpo")))
        run.wait_for("a GRPO checkpoint", lambda: resumable_step(folder), timeout=120)
        if mounted:
            fill(disk, leave=0)
        else:
            size = (home / "mlflow.db").stat().st_size
            resource.prlimit(run.proc.pid, resource.RLIMIT_FSIZE, (size, resource.RLIM_INFINITY))
        assert run.proc.wait(120) == 1, run.output()[-3000:]
        out = run.output()
        assert "Traceback" not in out and "database or disk is full" not in out and "disk I/O" not in out, \
            out[-3000:]
        lines = [line for line in out.splitlines() if line.startswith("r1:")]
        assert len(lines) == 1, out[-3000:]
        if mounted:
            assert lines[0].startswith(f"r1: the disk under {home} is full: ")
            assert lines[0].endswith("free some space (or point R1_HOME at a larger disk) and run the same command "
                                     "again to resume")
        else:
            assert lines[0].startswith(f"r1: writing {home}/") and lines[0].endswith(
                "stopped at this process's file size limit of {} (ulimit -f). Nothing saved was damaged: raise the "
                "limit and run the same command again to resume".format(size_text(size))), lines[0]
        status = {r.data.tags.get("stage", "pipeline"): r.info.status for r in run.runs()}
        # FAILED where the store took the write; else still RUNNING, for the next start to mark
        assert status["cold_start_sft"] == "FINISHED" and status["reasoning_grpo"] in ("FAILED", "RUNNING") \
            and status["pipeline"] == status["reasoning_grpo"], status
        killed = [r.info.run_id for r in run.runs() if r.info.status == "RUNNING"]
        step = resumable_step(folder)

        # the advice, followed: the home as it is, on a larger disk at another path, and the same command again
        roomy = tmp_path / "larger disk" / "home"
        shutil.copytree(home, roomy, symlinks=True)
        for db in (roomy / "mlflow.db", roomy / "prefect" / "prefect.db"):  # nothing saved was damaged
            with sqlite3.connect(db) as con:
                assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",), db
        moved_folder = roomy / folder.relative_to(home)
        assert verify_manifest(latest_checkpoint(moved_folder / "checkpoints")) is None

        runs.append(again := R1(roomy, args, code=code))
        assert again.proc.wait(300) == 0, again.output()[-3000:]
        out = again.output()
        assert "Traceback" not in out and f"R1_HOME has moved from {home} to {roomy}: " in out, out[-3000:]
        assert all(again.mlflow.get_run(r).info.status == "FAILED" for r in killed)  # marked at this start
        done = {r.data.tags.get("stage", "pipeline"): r for r in again.runs() if r.info.status == "FINISHED"
                and r.info.start_time > max(x.info.start_time for x in run.runs())}
        assert set(done) == {"pipeline", "cold_start_sft", "reasoning_grpo"}, done
        assert "r1.reused_from" in done["cold_start_sft"].data.tags
        assert done["reasoning_grpo"].data.tags["r1.resumed_from_step"] == str(step)
        assert done["reasoning_grpo"].data.tags["r1.work_dir.reasoning_grpo"] == str(moved_folder)

        # the same GRPO uninterrupted, from the same cold start (a local copy: a fresh work folder, this session's
        # store): the same weights
        uris = done["pipeline"].data.tags
        artifacts = lambda uri: roomy / "mlartifacts" / uri.split("/")[1] / "artifacts" / "checkpoint"  # noqa: E731
        whole = reasoning_grpo(str(artifacts(uris["uri.cold_start_checkpoint"])),
                               ReasoningGRPOConfig.model_validate(grpo))
        from runtime.tracking import download

        a = load_file(artifacts(uris["uri.reasoning_checkpoint"]) / "model.safetensors")
        b = load_file(download(whole.uris["checkpoint"], tmp_path / "whole") / "model.safetensors")
        start = load_file(artifacts(uris["uri.cold_start_checkpoint"]) / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert not all(torch.equal(a[k], start[k]) for k in a)  # GRPO did move the weights
    finally:
        for r in runs:
            r.kill()
        if mounted:
            subprocess.run(["umount", "-l", str(disk)], check=False)
