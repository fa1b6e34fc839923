"""The table `r1 run` ends with: a row a stage, within 120 columns, and `r1 show` one command away."""

from __future__ import annotations

from flows.cli.summary import WIDTH, table
from runtime.stage import StageResult

RUN = {s: f"{i}" * 32 for i, s in enumerate(("pipeline", "cold_start_sft", "reasoning_grpo", "rejection_sampling",
                                             "sft", "alignment_grpo"))}
# the tiny recipe's held-out phrasings: 450 prompts, 176 distinct requests under their lead-ins (`_n` counts requests)
PAIRED = {"alignment/handled_right_before": 0.818, "alignment/handled_right": 0.828,
          "alignment/handled_right_ci_low": 0.003, "alignment/handled_right_ci_high": 0.018,
          "alignment/handled_right_p": 0.012, "alignment/handled_right_n": 176.0}
DROPPED = {f"rejection/dropped/{why}": n for why, n in (("incorrect", 912_345), ("repetition", 41_000),
                                                       ("per_prompt_cap", 20_000), ("language_mix", 3_000),
                                                       ("overlong_chain", 1_200), ("code_in_chain", 17))}
METRICS = {
    "cold_start_sft": {"eval/accuracy": 0.49, "eval/pass_at_k": 0.63, "eval/format_rate": 0.99},
    "reasoning_grpo": {"eval/accuracy_before": 0.49, "eval/accuracy": 0.63, "eval/format_rate": 1.0},
    # R1's sizes: the counts are wide and many filters dropped something
    "rejection_sampling": {"rejection/generated": 1_600_000.0, "rejection/kept": 800_000.0,
                           "rejection/keep_rate": 0.5, "rejection/rows": 1_000_000.0,
                           "rejection/non_reasoning_rows": 200_000.0, "rejection/judge_asked": 123_456.0,
                           "rejection/judge_accepted": 100_000.0, "rejection/truncated": 5_000.0, **DROPPED},
    "sft": {"eval/accuracy": 0.7},
    "alignment_grpo": {"eval/accuracy_before": 0.7, "eval/accuracy": 0.71, "promotion/promoted": 1.0, **PAIRED},
}


def results() -> dict[str, StageResult]:
    uris = {"alignment_grpo": {"checkpoint": f"runs:/{RUN['alignment_grpo']}/checkpoint",
                               "registered_model": "models:/r1-tiny/3"}}
    return {s: StageResult(stage=s, run_id=RUN[s], uris=uris.get(s, {"checkpoint": f"runs:/{RUN[s]}/checkpoint"}),
                           metrics=m) for s, m in METRICS.items()}


def test_a_row_a_stage_with_its_key_figure_kept_rows_and_run_within_120_columns():
    text = table(results(), RUN["pipeline"])
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= WIDTH, [line for line in lines if len(line) > WIDTH]
    assert lines[0].split() == ["stage", "figure", "before", "->", "after", "kept", "rows", "MLflow", "run"]
    rows = {line.split()[0]: line.split() for line in lines[1:6]}
    assert list(rows) == list(METRICS)  # in the pipeline's order
    assert rows["cold_start_sft"] == ["cold_start_sft", "eval/accuracy", "0.490", RUN["cold_start_sft"]]
    assert rows["reasoning_grpo"] == ["reasoning_grpo", "eval/accuracy", "0.490", "->", "0.630", "(+0.140)",
                                      RUN["reasoning_grpo"]]
    assert rows["rejection_sampling"] == ["rejection_sampling", "keep", "rate", "0.500", "800000",
                                          RUN["rejection_sampling"]]
    assert rows["alignment_grpo"][-1] == RUN["alignment_grpo"]
    # the columns line up: each run id starts where the header's does
    assert {lines[i].index(RUN[s]) for i, s in enumerate(METRICS, 1)} == {lines[0].index("MLflow run")}

    notes = " ".join(" ".join(lines[6:]).split())  # the wrapped lines, joined again
    assert "rejection_sampling: kept 800000 of 1600000 samples (keep rate 0.500)" in notes
    assert "incorrect 912345" in notes and "code_in_chain 17" in notes  # wrapped, not cut
    assert ("alignment_grpo: alignment/handled_right: 0.818 -> 0.828 (+0.010, 95% CI +0.003..+0.018, p 0.012, "
            "n 176 requests)") in notes
    assert "alignment_grpo: registered_model: models:/r1-tiny/3" in notes
    assert "runs:/" not in notes  # the stages' own artifacts are `r1 show`'s
    assert lines[-1].endswith(f"show {RUN['pipeline']}")  # every other figure: one command away
    assert "eval/format_rate" not in text and "eval/pass_at_k" not in text


def test_a_stage_without_held_out_figures_still_has_its_row():
    lone = {"sft": StageResult(stage="sft", run_id=RUN["sft"], uris={}, metrics={})}
    lines = table(lone, RUN["sft"]).splitlines()
    assert lines[1].split() == ["sft", "-", "-", RUN["sft"]]
    assert lines[-1].endswith(f"show {RUN['sft']}")
