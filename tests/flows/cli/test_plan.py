"""`r1 plan`: rejection sampling sized before it runs (the arithmetic by hand, the command, a measured throughput)."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from flows.cli.plan import plan_text
from flows.cli.r1 import main
from grpo.configs.model import ModelConfig
from grpo.configs.recipe import RejectionSamplingConfig, load_recipe
from grpo.configs.rejection import RejectionConfig
from grpo.configs.sampling import SamplingConfig
from grpo.rejection.budget import ShardTiming, expected_kept_per_prompt, plan_against_run, plan_budget
from tiny_configs import TINY_MODEL as SMALL

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("k, p, cap", [(4, 0.3, 2), (4, 0.5, 0), (3, 0.9, 1), (5, 0.2, 3), (1, 0.7, 2)])
def test_kept_per_prompt_matches_counting_every_outcome(k, p, cap):
    naive = 0.0
    for passed in itertools.product([0, 1], repeat=k):  # every pass/fail pattern of the prompt's k samples
        x = sum(passed)
        naive += min(x, cap or k) * p**x * (1 - p) ** (k - x)
    assert expected_kept_per_prompt(k, p, cap) == pytest.approx(naive)


def test_the_budget_by_hand():
    cfg = RejectionConfig(samples_per_prompt=4, sampling=SamplingConfig(max_new_tokens=48), max_kept_per_prompt=2,
                          shard_size=100, target_samples=700, non_reasoning_rows=100)
    b = plan_budget(500, cfg, mean_fraction=0.5, keep_rate=0.5, tokens_per_s=1000, generators=2)
    assert (b.samples, b.shards) == (2000, 5)
    assert b.tokens == 2000 * 48 * 0.5  # 48,000
    # per prompt: P(X=1) = 4/16 keeps 1, P(X>=2) = 11/16 keeps 2: 0.25 + 1.375 = 1.625, x 500 prompts
    assert b.kept == pytest.approx(812.5)
    assert b.reasoning_rows == 600  # capped to target - non-reasoning
    assert b.generator_hours * 3600 == pytest.approx(48.0) and b.wall_hours * 3600 == pytest.approx(24.0)


def test_the_plan_against_the_run_by_hand():
    cfg = RejectionConfig(samples_per_prompt=4, sampling=SamplingConfig(max_new_tokens=48), shard_size=100)
    b = plan_budget(150, cfg, mean_fraction=0.5, keep_rate=0.5, tokens_per_s=1000, generators=2)
    # shard 0: 100 prompts x 4 samples x 48 x 0.5 = 9,600 tokens: 9.6 s at 1,000 tokens/s; shard 1 (50): 4.8 s
    # shard 0 took 19.2 s for 9,600 tokens (500/s, 2x the plan); shard 1 was written without a timing
    timings = [ShardTiming(400, 9600, 19.2, 3.0, 2.5, 250), None]
    rows, summary = plan_against_run(b, [100, 50], timings, kept=125)
    assert [r["predicted_s"] for r in rows] == pytest.approx([9.6, 4.8])
    assert rows[0]["measured_s"] == 19.2 and rows[0]["measured_over_predicted"] == pytest.approx(2.0)
    assert "measured_s" not in rows[1]  # no timing: left out of the sums, not counted as 0 s
    assert summary["plan/measured_over_predicted"] == pytest.approx(2.0)
    assert summary["plan/measured_tokens_per_s"] == pytest.approx(500.0)
    assert summary["plan/measured_mean_fraction"] == pytest.approx(9600 / (400 * 48))  # 0.5, as assumed
    assert summary["judge/calls_per_s"] == pytest.approx(100.0)  # 250 calls in 2.5 s
    assert summary["judge/calls_per_1k_kept"] == pytest.approx(2000.0)  # 250 calls for 125 rows
    # with a shard's samples spread over both endpoints, it is predicted at their sum: 2,000 tokens/s
    rows, _ = plan_against_run(b, [100, 50], timings, kept=125, spread_over_generators=True)
    assert [r["predicted_s"] for r in rows] == pytest.approx([4.8, 2.4])


@pytest.mark.parametrize("flag, value, message", [
    ("--mean-fraction", "0", "mean_fraction"),
    ("--keep-rate", "1.5", "keep_rate"),
    ("--tokens-per-s", "-3", "tokens_per_s"),
])
def test_a_bad_figure_fails_naming_it(capsys, flag, value, message):
    args = ["plan", "--tokens-per-s", "100", flag, value] if flag != "--tokens-per-s" else ["plan", flag, value]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_r1_plan_prints_the_budget_and_starts_nothing(tmp_path):
    home = tmp_path / "home"
    env = {**os.environ, "R1_HOME": str(home), "PREFECT_HOME": str(home / "prefect"), "PYTHONPATH": str(ROOT)}
    env.pop("MLFLOW_TRACKING_URI", None)
    out = subprocess.run([sys.executable, "-m", "flows.cli", "plan", "--recipe", "tiny", "--tokens-per-s", "1000",
                          "--keep-rate", "0.5"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert re.search(r"^prompts +500 +\(synthetic problems, num_train\)", text, re.M)
    assert re.search(r"^samples +2,000 +\(4 per prompt\)", text, re.M)
    assert re.search(r"^shards +5$", text, re.M)
    assert re.search(r"^completion tokens +48,000 ", text, re.M)
    assert re.search(r"^rows kept +812 ", text, re.M) or re.search(r"^rows kept +813 ", text, re.M)
    assert "1,000.0 tokens/s per generator (given)" in text and "48.0 s   (one generator)" in text
    # no MLflow store, no Prefect database: nothing was started
    assert not list(home.rglob("*.db")), sorted(home.rglob("*"))


def _small_stage(**generation) -> RejectionSamplingConfig:
    return RejectionSamplingConfig(model=ModelConfig(tiny=SMALL),
                                   data={"num_train": 30, "num_heldout": 0},
                                   rejection={"samples_per_prompt": 2, "shard_size": 10,
                                              "sampling": {"max_new_tokens": 8, "batch_size": 8},
                                              "target_samples": 50},
                                   generation=generation or {})


def _rate(text: str) -> float:
    return float(re.search(r"throughput +([\d,.]+) tokens/s", text).group(1).replace(",", ""))


def test_without_a_figure_plan_measures_the_recipes_model_here():
    text = plan_text(_small_stage())
    assert "(measured: " in text and "8 sequences of 'tiny' on " in text and "local backend" in text
    tokens, seconds = re.search(r"measured: ([\d,]+) tokens in ([\d.]+) s", text).groups()
    assert 0 < int(tokens.replace(",", "")) <= 8 * 8  # 4 prompts x 2 samples, at most 8 tokens each
    assert _rate(text) > 0


def test_with_the_http_backend_plan_measures_the_recipes_endpoints():
    from flows.cli.serve import make_server
    from grpo.models import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(ModelConfig(tiny=SMALL))
    server = make_server(model, tok, port=0, model_name="policy")
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        text = plan_text(_small_stage(backend="http", endpoints=[server.url], model="policy", max_in_flight=4))
    finally:
        server.shutdown()
        server.server_close()
    assert "from 1 endpoint(s) serving 'policy', 4 requests" in text and _rate(text) > 0


def test_the_docs_show_what_r1_plan_prints_for_the_800k_recipe():
    readme = (ROOT / "docs" / "rejection-at-scale.md").read_text()
    block = re.search(r"```\n\$ r1 plan --recipe r1-800k (.*?)\n(.*?)\n```", readme, re.S)
    assert block, "docs/rejection-at-scale.md's worked example of r1 plan is gone"
    flags = dict(zip(*[iter(block.group(1).split())] * 2))
    recipe = load_recipe("r1-800k")
    printed = plan_text(recipe.rejection_sampling, tokens_per_s=float(flags["--tokens-per-s"]),
                        mean_fraction=float(flags["--mean-fraction"]), keep_rate=float(flags["--keep-rate"]),
                        generators=int(flags["--generators"]))
    assert printed == block.group(2)
    rs = recipe.rejection_sampling.rejection
    assert (rs.target_samples, rs.non_reasoning_rows) == (800_000, 200_000)  # R1's 600k + 200k
