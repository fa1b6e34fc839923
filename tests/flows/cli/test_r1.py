"""The `r1` command: where things live, and bad arguments that fail before any work."""

from flows.cli.r1 import main


def test_where_names_the_state_folder_and_tracking_store(capsys, r1_home):
    assert main(["where"]) == 0
    out = capsys.readouterr().out
    assert str(r1_home) in out and "sqlite:///" in out


def test_unknown_recipe_fails_with_the_known_ones(capsys):
    assert main(["run", "--recipe", "no-such-recipe"]) == 2
    err = capsys.readouterr().err
    assert "no-such-recipe" in err and "tiny" in err


def test_a_stage_that_needs_a_checkpoint_says_so(capsys):
    assert main(["stage", "reasoning_grpo"]) == 2
    assert "--checkpoint" in capsys.readouterr().err


def test_unknown_stage_lists_the_stages(capsys):
    assert main(["stage", "no_such_stage"]) == 2
    assert "cold_start_sft" in capsys.readouterr().err


def test_set_flags_become_overrides_read_as_yaml():
    from flows.cli.preflight import parse_overrides

    given = ["cold_start_sft.train.max_steps=50", "reasoning_grpo.eval_before=false",
             "reasoning_grpo.grpo.rewards={accuracy: 1.0, format: 0.25}", "cold_start_sft.data.source=a=b.jsonl"]
    assert parse_overrides(given) == {"cold_start_sft.train.max_steps": 50, "reasoning_grpo.eval_before": False,
                                      "reasoning_grpo.grpo.rewards": {"accuracy": 1.0, "format": 0.25},
                                      "cold_start_sft.data.source": "a=b.jsonl"}  # split at the first "=" only
