"""The sweep's plots: one per setting that varies, a flat result drawn flat."""

from __future__ import annotations

import io

import pandas as pd

from runtime.sweep import setting_plots


def test_a_setting_with_one_value_gets_no_plot_and_a_flat_result_keeps_its_scale():
    table = pd.DataFrame({"reasoning_grpo.grpo.beta": [0.0, 0.0, 0.04, 0.04],
                          "reasoning_grpo.eval.num_prompts": [2, 2, 2, 2],
                          "reasoning_grpo/eval/accuracy": [0.25, 0.25, 0.25, 0.25]})
    plots = setting_plots(table, ["reasoning_grpo.grpo.beta", "reasoning_grpo.eval.num_prompts"],
                          ["reasoning_grpo/eval/accuracy"])
    assert list(plots) == ["reasoning_grpo_eval_accuracy--reasoning_grpo.grpo.beta.png"]

    import matplotlib.image

    image = matplotlib.image.imread(io.BytesIO(plots["reasoning_grpo_eval_accuracy--reasoning_grpo.grpo.beta.png"]))
    assert image.shape[:2] == (400, 640)
