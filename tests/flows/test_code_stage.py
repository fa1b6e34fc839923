"""The reasoning GRPO stage on code rows, as a Prefect flow logging to MLflow: trained with the `code` reward and
evaluated before and after on held-out code problems, whose `eval/accuracy` is pass@1 through the sandbox. The stage
starts from a tiny model taught to answer every problem with one program, right for the first held-out problem and
wrong for the second, so the figure is one half only where each program is run against its own row's tests.

Needs bubblewrap (`apt-get install -y bubblewrap`): skipped without it, failed in CI.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo.configs.model import ModelConfig
from tiny_configs import TINY, TINY_MODEL

DATA = Path(__file__).resolve().parents[2] / "recipes" / "data"
MBPP = {"prompt": "text", "tests": "test_list", "setup": "test_setup_code"}

# the one answer the stage's model gives: square(n) passes the first held-out problem's 3 tests (square) and none of
# the second's (is_palindrome, a name it does not define); 39 tokens
SQUARE = "<think>I write it.</think><answer>```python\ndef square(n):\n    return n * n\n```</answer>"

# as small as a stage gets: two GRPO steps of 2 prompts x 4 completions, two held-out problems, training completions
# cut at 12 tokens (before any program: every reward 0), held-out ones long enough for SQUARE and its end
CODE_GRPO = {
    "model": {"tiny": TINY},
    "data": {"source": str(DATA / "code_problems.jsonl"), "columns": MBPP, "num_train": 0,
             "heldout_source": str(DATA / "code_problems_heldout.jsonl"), "num_heldout": 2},
    "grpo": {"max_steps": 2, "prompts_per_step": 2, "num_generations": 4, "sampling": {"max_new_tokens": 12},
             "samples_every": 1, "checkpoint_every": 0, "mixed_precision": "no",
             "rewards": {"code": 1.0, "format": 0.5}, "code": {"workers": 2}},
    "eval": {"num_prompts": 2, "num_samples": 0, "max_new_tokens": 48, "num_logged_samples": 2},
}


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory) -> str:
    """The tiny model taught SQUARE as its answer to every code problem's prompt, training and held-out (150 SFT
    steps, ~10 s; greedy, each of its tokens then has a probability near 0.99), saved as the stage's checkpoint."""
    import pandas as pd

    from grpo.configs.data import DataConfig
    from grpo.configs.training import SFTConfig
    from grpo.data.tables import load_rl_data
    from grpo.models import load_model_and_tokenizer
    from grpo.training.loops.sft_trainer import train_sft

    train, heldout = load_rl_data(DataConfig(source=str(DATA / "code_problems.jsonl"), columns=MBPP, num_train=0,
                                             heldout_source=str(DATA / "code_problems_heldout.jsonl"), num_heldout=8))
    prompts = train["prompt"].tolist() + heldout["prompt"].tolist()
    model, tokenizer = load_model_and_tokenizer(ModelConfig(tiny=TINY_MODEL))
    out = tmp_path_factory.mktemp("code-base")
    train_sft(model, tokenizer, pd.DataFrame({"prompt": prompts, "response": [SQUARE] * len(prompts)}),
              SFTConfig(max_steps=150, batch_size=10, learning_rate=5e-3, warmup_steps=2, mixed_precision="no",
                        checkpoint_every=0), out, progress=False)
    return str(out / "model")


def test_reasoning_grpo_on_code_rows_reports_pass_at_1_on_held_out_code(bwrap, prefect_harness, mlflow_client,
                                                                      base_checkpoint, tmp_path):
    from flows.reasoning_grpo import reasoning_grpo
    from grpo.configs.recipe import ReasoningGRPOConfig
    from runtime.tracking import download
    from tasks.data import read_frame

    result = reasoning_grpo(base_checkpoint, ReasoningGRPOConfig.model_validate(CODE_GRPO))
    run = mlflow_client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["stage"] == "reasoning_grpo"
    # trained with the code reward on the MBPP rows (no answer column anywhere)
    assert [m.step for m in mlflow_client.get_metric_history(result.run_id, "reward/code")] == [1, 2]
    assert "answer" not in read_frame(result.uris["dataset"]).columns
    # held-out pass@1 before (step 0) and after (step 2), on the same run and in the stage's headline figures
    history = mlflow_client.get_metric_history(result.run_id, "eval/accuracy")
    assert [m.step for m in history] == [0, 2]
    assert [m.value for m in history] == [result.metrics["eval/accuracy_before"], result.metrics["eval/accuracy"]]
    # the rows scored were the held-out code problems, each judged by running its tests
    tables = {}
    for step in (0, 2):
        table = json.loads(download(f"runs:/{result.run_id}/eval/samples_step_{step}.json",
                                    tmp_path / f"t{step}").read_text())
        columns = table["columns"]
        assert "tests_passed" in columns, columns
        tables[step] = rows = [dict(zip(columns, row)) for row in table["data"]]
        assert [r["answer"] for r in rows] == ["3 tests", "3 tests"]
        assert all(r["tests_passed"].endswith("/3") for r in rows)
        # pass@1 is the table's share of rows whose every test passed
        assert [r["correct"] for r in rows] == [float(r["tests_passed"] == "3/3") for r in rows]
        headline = result.metrics["eval/accuracy_before" if step == 0 else "eval/accuracy"]
        assert headline == sum(r["correct"] for r in rows) / len(rows)
    # before training the model answers SQUARE to both: square's 3 tests pass, is_palindrome's 3 fail (NameError)
    before = tables[0]
    assert [r["completion"] for r in before] == [SQUARE, SQUARE]
    assert [(r["tests_passed"], r["correct"]) for r in before] == [("3/3", 1.0), ("0/3", 0.0)]
    assert result.metrics["eval/accuracy_before"] == 0.5
