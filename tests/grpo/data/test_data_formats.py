"""Real dataset formats by configuration alone: column mapping, answer formats, hub layouts, and their errors."""

import json

import pandas as pd
import pytest

from grpo.configs.data import DataConfig
from grpo.configs.recipe import RecipeError, load_recipe
from grpo.data.formats import gsm8k_answer
from grpo.data.tables import DataError, dropped_rows, load_heldout, load_rl_data, load_sft_data
from grpo.rewards import accuracy_reward, format_reward
from gsm8k_data import gsm8k_rows

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
                                        r"'#### <number>' line .*2 of 6 rows"):
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


def test_a_gsm8k_answer_that_is_not_a_number_names_file_row_and_value(tmp_path):
    rows = gsm8k_rows(20)
    rows[17]["answer"] = rows[17]["answer"].rsplit("####", 1)[0] + "#### seventy"
    path = write_jsonl(tmp_path / "gsm.jsonl", rows)
    with pytest.raises(DataError) as e:
        load_rl_data(DataConfig(source=path, num_heldout=0, **GSM8K))
    msg = str(e.value)
    assert "\n" not in msg  # one line, though the cell is a multi-line solution
    assert msg.startswith(f"{path}: row 17, column 'answer': expected a solution ending in a '#### <number>' line")
    assert "got '#### seventy'" in msg and "1 of 20 rows" in msg and "data.unreadable_answers" in msg
    # the SFT loader reads the same column the same way
    with pytest.raises(DataError, match=r"row 17, .*got '#### seventy'"):
        load_sft_data(DataConfig(source=path, num_heldout=0, **GSM8K))


def test_plain_numbers_after_gsm8k_marks_are_read():
    for tail, answer in [("1,234", "1234"), ("-3", "-3"), ("+7", "+7"), ("2.50", "2.50"), (".5", ".5"),
                         ("3/4", "3/4"), (" 72 ", "72")]:
        assert gsm8k_answer(f"Work.\n#### {tail}") == answer, tail
    for tail in ["seventy", "72 cows", "$72", "1/", "--3", "3/4/5", "1e3", ""]:
        assert gsm8k_answer(f"Work.\n#### {tail}") is None, tail


def test_unreadable_answers_drop_leaves_the_rows_out_and_counts_them(tmp_path, caplog):
    rows = gsm8k_rows(20)
    rows[17]["answer"] = rows[17]["answer"].rsplit("####", 1)[0] + "#### seventy"
    rows[4]["answer"] = "They have 12 cows."  # no #### at all: the same switch
    path = write_jsonl(tmp_path / "gsm.jsonl", rows)
    heldout = write_jsonl(tmp_path / "test.jsonl", gsm8k_rows(5, start=50))
    cfg = DataConfig(source=path, heldout_source=heldout, unreadable_answers="drop", **GSM8K)
    train, held = load_rl_data(cfg)
    kept = [r for i, r in enumerate(rows) if i not in (4, 17)]
    assert len(train) == 18 and dropped_rows(train) == 2 and dropped_rows(held) == 0
    assert train["prompt"].tolist() == [r["question"] for r in kept]  # each prompt still has its own answer
    assert train["answer"].tolist() == [r["answer"].rsplit("#### ", 1)[1].replace(",", "") for r in kept]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(m.startswith(f"{path}: dropped 2 of 20 rows") and "row 4" in m for m in warned), warned
    # SFT responses are built from the rows that are left, each from its own solution
    sft, _ = load_sft_data(cfg.model_copy(update={"num_heldout": 0}))
    assert len(sft) == 18 and dropped_rows(sft) == 2
    assert sft["response"][17].endswith(f"<answer>{train['answer'][17]}</answer>")
    # num_train counts the rows that are left
    assert len(load_rl_data(cfg.model_copy(update={"num_train": 18}))[0]) == 18
    # MATH rows without a \boxed{} are the same kind of row: one switch for both formats
    math = [{"problem": "1+1?", "solution": "So $\\boxed{2}$."}, {"problem": "2+2?", "solution": "It is 4."}]
    math_file = write_jsonl(tmp_path / "math.jsonl", math)
    boxed = DataConfig(source=math_file, columns={"prompt": "problem", "answer": "solution"}, answer_format="boxed",
                       num_heldout=0)
    with pytest.raises(DataError, match=r"math\.jsonl: row 1, column 'solution': expected a solution with a "
                                        r"\\boxed\{\.\.\.\}.*got 'It is 4\.'"):
        load_rl_data(boxed)
    train, _ = load_rl_data(boxed.model_copy(update={"unreadable_answers": "drop"}))
    assert train["answer"].tolist() == ["2"] and dropped_rows(train) == 1
    # a file where no answer can be read is still an error: nothing would be left to train on
    none = write_jsonl(tmp_path / "none.jsonl", [{"question": "q", "answer": "#### many"}] * 3)
    with pytest.raises(DataError, match=r"none\.jsonl: no row has an answer that can be read.*all 3"):
        load_rl_data(DataConfig(source=none, num_heldout=0, unreadable_answers="drop", **GSM8K))


def test_the_data_task_logs_how_many_rows_were_dropped(prefect_harness, mlflow_client, tmp_path):
    from runtime import tracking
    from tasks.data import prepare_data, read_frame

    rows = gsm8k_rows(20)
    rows[17]["answer"] = rows[17]["answer"].rsplit("####", 1)[0] + "#### seventy"
    path = write_jsonl(tmp_path / "gsm.jsonl", rows)
    cfg = DataConfig(source=path, num_heldout=0, unreadable_answers="drop", **GSM8K)
    run_id = tracking.start_run("reasoning_grpo", tags={"stage": "reasoning_grpo"})
    uris = prepare_data(run_id, cfg, "rl")
    metrics = mlflow_client.get_run(run_id).data.metrics
    assert metrics["data/dropped_train_rows"] == 1 and metrics["data/dropped_heldout_rows"] == 0
    assert len(read_frame(uris.train)) == 19 and uris.heldout is None  # the rows the stage trains on


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
