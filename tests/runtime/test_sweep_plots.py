"""The sweep's plots: one per setting that varies, a flat result drawn flat."""

from __future__ import annotations

import io

import pandas as pd
import pytest

from runtime.sweep import setting_figures, setting_plots


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


def test_a_flat_result_is_drawn_flat_at_its_own_scale_and_a_moving_one_is_not():
    """Equal results (to within rounding) get an axis of +-10% around their value, titled with it, so noise in the
    last digit is not magnified to fill the plot; results that differ keep matplotlib's own limits around them."""
    flat = pd.DataFrame({"grpo.beta": [0.0, 0.0, 0.04, 0.04],
                         "eval/accuracy": [0.25, 0.25, 0.25, 0.25 + 1e-12]})
    (fig,) = setting_figures(flat, ["grpo.beta"], ["eval/accuracy"]).values()
    (ax,) = fig.axes
    low, high = ax.get_ylim()
    assert (low, high) == pytest.approx((0.2, 0.3)) and ax.get_title().endswith(": all 0.25")
    moving = flat.assign(**{"eval/accuracy": [0.25, 0.27, 0.5, 0.52]})
    (fig,) = setting_figures(moving, ["grpo.beta"], ["eval/accuracy"]).values()
    (ax,) = fig.axes
    low, high = ax.get_ylim()
    assert low < 0.25 < 0.52 < high < 0.6 and "all" not in ax.get_title()
