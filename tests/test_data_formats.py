"""Real dataset formats by configuration alone: column mapping, answer formats, hub layouts, and their errors."""

import json

import pandas as pd
import pytest
from conftest import gsm8k_rows

from grpo.config import DataConfig
from grpo.recipe import RECIPES_DIR, RecipeError, load_recipe
from grpo.data.tables import DataError, load_heldout, load_rl_data, load_sft_data
from grpo.rewards import accuracy_reward, format_reward

GSM8K = {"columns": {"prompt": "question"}, "answer_format": "gsm8k"}


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_gsm8k_rows_load_with_their_columns_named_and_clean_answers(tmp_path):
    rows = gsm8k_rows(20)
    train_file = write_jsonl(tmp_path / "train.jsonl", rows)
    test_file = write_jsonl(tmp_path / "test.jsonl", gsm8k_rows(5, start=50))
    train, heldout = load_rl_data(DataConfig(source=train_file, heldout_source=test_file, **GSM8K))
    assert list(train.columns) == ["prompt", "answer"] and len(train) == 20
    assert train["prompt"].tolist() == [r["question"] for r in rows]
    # "#### 1,153" -> "1153": the number after ####, commas removed
    assert train["answer"].tolist() == [r["answer"].rsplit("#### ", 1)[1].replace(",", "") for r in rows]
    assert any("#### 1," in r["answer"] for r in rows) and all(a.isdigit() for a in train["answer"])
    # held-out files get the same mapping and format
    assert list(heldout.columns) == ["prompt", "answer"] and len(heldout) == 5
    assert heldout["answer"][0] == str(3 + 50 + (2 + 0) * (200 + 350))


def test_gsm8k_worked_solutions_become_sft_responses(tmp_path):
    rows = gsm8k_rows(3)
    train, heldout = load_sft_data(DataConfig(source=write_jsonl(tmp_path / "g.jsonl", rows), num_heldout=0, **GSM8K))
    assert list(train.columns) == ["prompt", "response"] and heldout is None
    assert train["response"][0] == ("<think>It buys 2*200 = 400 cows.\nIt has 3+400 = 403 cows.</think>"
                                    "<answer>403</answer>")  # GSM8K's <<2*200=400>> calculator notes are gone
    assert format_reward(train["response"].tolist()) == [1.0, 1.0, 1.0]
    assert accuracy_reward(train["response"].tolist(), answer=["403", "413", "1,609"]) == [1.0, 0.0, 0.0]


def test_boxed_answers_from_math_shaped_rows(tmp_path):
    # MATH-500's shape: the dataset has an `answer` column of its own; the role mapped from `solution` wins
    rows = [{"problem": "What is $\\frac{2}{4}$ in lowest terms?", "level": 1, "answer": "0.5",
             "solution": "Divide by 2: $\\frac{2}{4} = \\boxed{\\frac{1}{2}}$."},
            {"problem": "Simplify $\\sqrt{8}$.", "level": 2, "answer": "2sqrt2",
             "solution": "First $\\boxed{8}$ is wrong; $\\sqrt{8} = \\boxed{2\\sqrt{2}}$."}]
    path = tmp_path / "math.parquet"
    pd.DataFrame(rows).to_parquet(path)
    cfg = DataConfig(source=str(path), columns={"prompt": "problem", "answer": "solution"}, answer_format="boxed",
                     num_heldout=0)
    train, _ = load_rl_data(cfg)
    assert train["answer"].tolist() == ["\\frac{1}{2}", "2\\sqrt{2}"]  # the last box, nested braces kept
    assert train["prompt"][0] == rows[0]["problem"]
    assert list(train.columns) == ["prompt", "answer", "level"]  # other columns ride along for the rewards
    sft, _ = load_sft_data(cfg)
    assert sft["response"][0] == f"<think>{rows[0]['solution']}</think><answer>\\frac{{1}}{{2}}</answer>"


def test_a_mapped_column_that_is_not_there_names_file_column_and_what_it_has(tmp_path):
    path = write_jsonl(tmp_path / "gsm.jsonl", gsm8k_rows(3))
    with pytest.raises(DataError) as e:
        load_rl_data(DataConfig(source=path, columns={"prompt": "questions"}, answer_format="gsm8k"))
    msg = str(e.value)
    assert msg.startswith(f"{path}: missing column(s) ['questions']") and "prompt from 'questions'" in msg
    assert "found columns ['question', 'answer']" in msg
    # GSM8K's own file with no mapping: the missing role and how to map it
    with pytest.raises(DataError, match=r"missing column\(s\) \['prompt'\].*data\.columns"):
        load_rl_data(DataConfig(source=path))
    # SFT on worked solutions without a format: says how to build responses from them
    with pytest.raises(DataError, match=r"missing column\(s\) \['response'\].*data\.answer_format"):
        load_sft_data(DataConfig(source=path, columns={"prompt": "question"}))


def test_an_answer_that_cannot_be_read_names_file_row_and_column(tmp_path):
    rows = gsm8k_rows(6)
    rows[3]["answer"] = "They have 12 cows."  # no #### line
    rows[5]["answer"] = "#### "
    path = write_jsonl(tmp_path / "gsm.jsonl", rows)
    with pytest.raises(DataError, match=r"gsm\.jsonl: row 3, column 'answer': expected a solution ending in a "
                                        r"'#### <answer>' line .*2 of 6 rows"):
        load_rl_data(DataConfig(source=path, **GSM8K))
    with pytest.raises(DataError, match=r"row 0, column 'answer': expected a solution with a \\boxed\{\.\.\.\}"):
        load_rl_data(DataConfig(source=path, columns={"prompt": "question"}, answer_format="boxed"))
    # a held-out file is held to the same format
    good = write_jsonl(tmp_path / "good.jsonl", gsm8k_rows(4))
    with pytest.raises(DataError, match=r"gsm\.jsonl: row 3, column 'answer'"):
        load_heldout(DataConfig(source=good, heldout_source=path, **GSM8K))
    # a bare number where a solution is expected
    nums = write_jsonl(tmp_path / "nums.jsonl", [{"question": "q", "answer": 4}])
    with pytest.raises(DataError, match=r"row 0, column 'answer': expected text"):
        load_rl_data(DataConfig(source=nums, **GSM8K))


def test_unknown_roles_fail_when_the_recipe_is_read(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("reasoning_grpo:\n  data:\n    columns: {question: prompt}\n    answer_format: gsm8\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(path)
    assert "reasoning_grpo.data.columns" in str(e.value) and "unknown role(s) ['question']" in str(e.value)
    assert "reasoning_grpo.data.answer_format" in str(e.value)


def test_a_hub_layout_folder_loads_by_subset_and_split(gsm8k_copy):
    cfg = DataConfig(source=str(gsm8k_copy), subset="main", heldout_source=str(gsm8k_copy), num_train=0, **GSM8K)
    train, heldout = load_rl_data(cfg)  # load_dataset(folder, "main", split="train"), as for openai/gsm8k
    assert len(train) == 20 and len(heldout) == 8  # held-out from the test split
    assert train["answer"][0] == "403" and heldout["answer"][0] == str(3 + 100 + 2 * 900)
    with pytest.raises(DataError, match=r"gsm8k\d*.* \(subset 'socratic', split 'train'\): cannot load it.*'main'"):
        load_rl_data(cfg.model_copy(update={"subset": "socratic"}))
    with pytest.raises(DataError, match=r"split 'validation'.*cannot load it"):
        load_heldout(cfg.model_copy(update={"heldout_split": "validation"}))


def test_every_shipped_recipe_loads():
    names = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    assert {"tiny", "gsm8k"} <= set(names)
    for name in names:
        assert load_recipe(name).name == name


def test_the_gsm8k_recipe_reads_a_local_copy_of_openai_gsm8k(gsm8k_copy):
    recipe = load_recipe("gsm8k")
    for stage in ("cold_start_sft", "reasoning_grpo", "rejection_sampling", "alignment_grpo"):
        data = getattr(recipe, stage).data
        assert (data.source, data.subset, data.answer_format) == ("openai/gsm8k", "main", "gsm8k"), stage
        local = data.model_copy(update={"source": str(gsm8k_copy), "heldout_source": str(gsm8k_copy)})
        train, heldout = (load_sft_data if stage == "cold_start_sft" else load_rl_data)(local)
        assert len(train) == 20 and len(heldout) == 8, stage
        if stage == "cold_start_sft":
            assert train["response"][0].endswith("</think><answer>403</answer>")
        else:
            assert train["answer"][0] == "403"
