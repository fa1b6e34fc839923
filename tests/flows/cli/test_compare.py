"""`r1 compare`: two pipeline runs built through the real MLflow client (SQLite in the session's temp folder)."""

from __future__ import annotations

from flows.cli.compare import compare, stage_runs
from flows.cli.r1 import main
from runs import make_pipeline
from runtime import tracking


def test_children_are_found_by_stage_tag_in_recipe_order():
    parent = make_pipeline("0.001", 0.25, stages=("reasoning_grpo", "cold_start_sft"))
    runs = stage_runs(parent)
    assert list(runs) == ["cold_start_sft", "reasoning_grpo"]
    assert all(r.data.tags["mlflow.parentRunId"] == parent for r in runs.values())


def test_compare_shows_differing_params_and_metrics_side_by_side(capsys):
    a = make_pipeline("0.001", 0.25)
    b = make_pipeline("0.0005", 0.5, stages=("cold_start_sft",), recipe="small")
    text = compare(a, b)
    lines = text.splitlines()
    assert lines[0].startswith(f"A: {a}") and lines[1].startswith(f"B: {b}")
    pipeline = lines[lines.index(next(l for l in lines if "pipeline params that differ" in l)):]
    assert any(l.split() == ["recipe", "tiny", "small"] for l in pipeline)

    cold = text.split("== cold_start_sft")[1].split("==")[0]
    rows = [l.split() for l in cold.splitlines()]
    assert ["train.learning_rate", "0.001", "0.0005"] in rows
    assert not any(r and r[0] == "train.max_steps" for r in rows)  # the same in both: not shown
    assert not any(r and r[0].startswith("input.") for r in rows)  # upstream URIs always differ: left out
    assert ["eval/accuracy", "0.25", "0.5", "+0.25"] in rows  # the last values, and B - A
    assert ["train/loss", "1", "1", "+0"] in rows

    grpo = text.split("== reasoning_grpo")[1]
    assert "(not run)" in grpo.splitlines()[0]  # a stage only A ran
    assert ["eval/accuracy", "0.25", "-"] in [l.split() for l in grpo.splitlines()]

    assert main(["compare", a, b]) == 0
    assert capsys.readouterr().out.strip() == text


def test_compare_names_a_bad_run(capsys):
    a = make_pipeline("0.001", 0.25)
    assert main(["compare", a, "0123456789abcdef0123456789abcdef"]) == 2
    assert "0123456789abcdef0123456789abcdef" in capsys.readouterr().err
    child = stage_runs(a)["cold_start_sft"].info.run_id  # a stage run is not a pipeline run
    assert main(["compare", child, child]) == 2
    assert "pipeline runs" in capsys.readouterr().err


def test_compare_takes_three_runs_or_a_sweep_run_for_its_points(capsys):
    a, b, c = (make_pipeline(lr, acc) for lr, acc in (("0.001", 0.25), ("0.002", 0.5), ("0.003", 0.75)))
    text = compare(a, b, c)
    lines = text.splitlines()
    assert [line.split()[0] for line in lines[:3]] == ["A:", "B:", "C:"]
    cold = [line.split() for line in text.split("== cold_start_sft")[1].split("==")[0].splitlines()]
    assert ["train.learning_rate", "0.001", "0.002", "0.003"] in cold
    assert ["eval/accuracy", "0.25", "0.5", "0.75"] in cold  # no B-A with three
    assert "A and B and C compared" in text

    # a sweep run (r1 sweep) stands for its finished points, in the sweep's order
    sweep = tracking.start_run("r1_sweep:tiny", tags={"r1.sweep.key": "k", "r1.sweep.recipe": "tiny"})
    for index, run_id in ((1, c), (0, a)):
        tracking.set_tags(run_id, {"r1.sweep": sweep, "r1.sweep.index": str(index)})
    assert compare(sweep) == compare(a, c)
    assert main(["compare", sweep]) == 0 and capsys.readouterr().out.strip() == compare(a, c)
    lonely = tracking.start_run("r1_sweep:tiny", tags={"r1.sweep.key": "k2"})
    assert main(["compare", lonely]) == 2
    assert "0 pipeline run(s) to compare; give two or more" in capsys.readouterr().err


def test_a_reused_stage_is_compared_by_the_run_that_did_its_work_and_system_figures_stay_out():
    """B reused A's cold start (its run holds metrics, no params): no param "differs" there; the machine's system/*
    figures are not results and are not listed."""
    a = make_pipeline("0.001", 0.25)
    worked = stage_runs(a)["cold_start_sft"].info.run_id
    b = tracking.start_run("r1_pipeline:tiny", tags={"recipe": "tiny"})
    tracking.log_params(b, {"recipe": "tiny", "stages": "cold_start_sft"})
    reused = tracking.start_run("cold_start_sft", tags={"stage": "cold_start_sft", "r1.reused_from": worked},
                                parent_run_id=b)
    log = tracking.MetricsLogger(reused)
    log(4, {"eval/accuracy": 0.25, "system/cpu_utilization_percentage": 93.0})
    tracking.end_run(reused)
    tracking.end_run(b)
    cold = compare(a, b).split("== cold_start_sft")[1].split("==")[0]
    assert f"(reused {worked})" in cold.splitlines()[0]
    assert "params that differ: none" in cold
    assert "system/" not in cold and ["eval/accuracy", "0.25", "0.25", "+0"] in [l.split() for l in cold.splitlines()]


def test_show_prints_every_figure_of_each_stage_and_the_uris_they_made(capsys):
    from flows.cli.compare import show
    from runtime.stage import StageResult, record_result

    parent = make_pipeline("0.001", 0.25)
    cold = stage_runs(parent)["cold_start_sft"].info.run_id
    record_result(StageResult(stage="cold_start_sft", run_id=cold, uris={"checkpoint": f"runs:/{cold}/checkpoint"}))
    tracking.MetricsLogger(cold)(4, {"system/cpu_utilization_percentage": 50.0})
    assert main(["show", parent]) == 0
    text = capsys.readouterr().out.strip()
    assert text == show(parent) and text.splitlines()[0].startswith(f"{parent}  r1_pipeline:tiny  FINISHED")
    sections = {part.splitlines()[0].split()[0]: part for part in text.split("== ")[1:]}
    assert list(sections) == ["cold_start_sft", "reasoning_grpo"]
    rows = [line.split() for line in sections["cold_start_sft"].splitlines()]
    assert ["eval/accuracy", "0.25"] in rows and ["train/loss", "1"] in rows  # the last values
    assert ["checkpoint:", f"runs:/{cold}/checkpoint"] in rows
    assert "system/" not in text  # the machine's figures: the MLflow UI's system metrics tab
    assert f"runs/{parent}" in text  # the run's page

    assert main(["show", cold]) == 0  # a stage run alone
    alone = capsys.readouterr().out
    assert f"== cold_start_sft  (run {cold}, FINISHED)" in alone and "reasoning_grpo" not in alone

    # a later pipeline that reused that stage: the figures of the run that did the work, with the reusing run's own
    again = tracking.start_run("r1_pipeline:tiny", tags={"recipe": "tiny"})
    reusing = tracking.start_run("cold_start_sft", tags={"stage": "cold_start_sft", "r1.reused_from": cold},
                                 parent_run_id=again)
    tracking.MetricsLogger(reusing)(4, {"eval/accuracy": 0.25})
    tracking.end_run(reusing)
    tracking.end_run(again)
    rows = [line.split() for line in show(again).splitlines()]
    assert ["eval/accuracy", "0.25"] in rows and ["train/loss", "1"] in rows
    assert f"(run {reusing}, FINISHED, reused {cold})" in show(again)


def test_show_names_a_run_that_is_not_there(capsys):
    make_pipeline("0.001", 0.25)  # the store exists
    assert main(["show", "0123456789abcdef0123456789abcdef"]) == 2
    assert "RUN: no MLflow run '0123456789abcdef0123456789abcdef'" in capsys.readouterr().err
