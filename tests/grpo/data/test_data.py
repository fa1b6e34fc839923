"""The synthetic task and the loaders: determinism, disjoint splits, and errors that name file, row and column."""

import json
import re

import pandas as pd
import pytest

from grpo.configs.data import DataConfig, TaskConfig
from grpo.data.arithmetic import count_out, format_response, generate_problems
from grpo.data.tables import DataError, load_rl_data, load_sft_data, read_table


def test_problems_are_deterministic_and_correct():
    cfg = TaskConfig(max_operand=9, seed=3)
    a, b = generate_problems(cfg, 50, "train"), generate_problems(cfg, 50, "train")
    assert a == b
    assert generate_problems(TaskConfig(seed=4), 50, "train") != a
    for p in a:
        # each step "x op y = z" is true arithmetic, and the last step's result is the answer
        for step in p.steps:
            lhs, rhs = step.split(" = ")
            assert eval(lhs) == int(rhs)  # noqa: S307 (our own generated digits and operators)
        assert int(p.steps[-1].split(" = ")[1]) == p.answer
        assert p.answer >= 0


def test_train_and_heldout_never_share_a_problem_even_under_another_name():
    from grpo.data.arithmetic import NAMES

    def arithmetic(question):  # the problem with the person's name taken out
        for name in NAMES:
            question = question.replace(name, "_")
        return question

    cfg = TaskConfig(max_operand=6)
    train = {arithmetic(p.question) for p in generate_problems(cfg, 3000, "train")}
    heldout = [arithmetic(p.question) for p in generate_problems(cfg, 200, "heldout")]
    assert len(set(heldout)) == 200  # distinct problems, not one problem under several names
    assert not train & set(heldout)


def test_response_has_the_think_answer_shape():
    p = generate_problems(TaskConfig(), 1, "train")[0]
    r = format_response(p)
    assert r.startswith("<think>") and r.endswith(f"</think><answer>{p.answer}</answer>")


def test_too_small_question_space_fails_clearly():
    with pytest.raises(ValueError, match="fewer than"):
        generate_problems(TaskConfig(max_operand=1, templates=("coins",)), 50, "train")


def test_jsonl_with_a_missing_column_names_file_and_column(tmp_path):
    path = tmp_path / "cold.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer_text": "x"}) for i in range(3)))
    with pytest.raises(DataError) as e:
        load_sft_data(DataConfig(source=str(path)))
    assert str(path) in str(e.value) and "'response'" in str(e.value)


def test_mistyped_cell_names_row_and_column(tmp_path):
    path = tmp_path / "cold.parquet"
    pd.DataFrame({"prompt": ["a", "b", "c"], "response": ["x", "", "z"]}).to_parquet(path)
    with pytest.raises(DataError, match=r"row 1, column 'response'"):
        load_sft_data(DataConfig(source=str(path)))


def test_bad_json_line_is_named(tmp_path):
    path = tmp_path / "rl.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", \n')
    with pytest.raises(DataError, match="line 2"):
        read_table(str(path))


def test_user_formats_load(tmp_path):
    import datasets

    rows = [{"prompt": [{"role": "user", "content": "2+2?"}], "answer": 4}, {"prompt": "3+3?", "answer": "6"}]
    jsonl = tmp_path / "rl.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows))
    train, _ = load_rl_data(DataConfig(source=str(jsonl), num_heldout=0))
    assert train["answer"].tolist() == ["4", "6"]  # numbers become text
    assert train["prompt"][0] == [{"role": "user", "content": "2+2?"}]

    folder = tmp_path / "saved"
    datasets.Dataset.from_list([{"prompt": "q", "response": "<think>t</think><answer>1</answer>"}]).save_to_disk(folder)
    train, _ = load_sft_data(DataConfig(source=str(folder), num_heldout=0))
    assert train["response"].tolist() == ["<think>t</think><answer>1</answer>"]


def test_missing_file_is_named(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_sft_data(DataConfig(source=str(tmp_path / "nope.jsonl")))


def test_synthetic_loaders_give_both_splits():
    train, heldout = load_sft_data(DataConfig(num_train=100, num_heldout=20))
    assert list(train.columns) == ["prompt", "response"] and len(train) == 100
    assert list(heldout.columns) == ["prompt", "answer"] and len(heldout) == 20
    assert not set(train["prompt"]) & set(heldout["prompt"])


def test_every_seed_scores_on_the_same_heldout_problems():
    a = generate_problems(TaskConfig(seed=0), 50, "heldout")
    b = generate_problems(TaskConfig(seed=1), 50, "heldout")
    assert a == b
    assert generate_problems(TaskConfig(seed=0), 50, "train") != generate_problems(TaskConfig(seed=1), 50, "train")


def test_count_out_ends_on_the_result():
    assert count_out("9 + 3 = 12") == "9 + 3 = 10 11 12"
    assert count_out("7 - 2 = 5") == "7 - 2 = 6 5"
    assert count_out("2 * 3 = 6") == "2 * 3 = 6"  # products are recalled
    assert count_out("4 - 0 = 4") == "4 - 0 = 4"


def test_counting_share_mixes_both_habits_in_a_fixed_share():
    task = TaskConfig(max_operand=6, counting_share=0.5)
    rows, _ = load_sft_data(DataConfig(num_train=400, num_heldout=0, task=task))
    counted = rows["response"].str.contains(r"= [0-9]+ [0-9]+")
    assert 0.4 < counted.mean() < 0.6  # chosen by hash: about half, not exactly
    again, _ = load_sft_data(DataConfig(num_train=400, num_heldout=0, task=task))
    assert again["response"].tolist() == rows["response"].tolist()
    # both habits restate the givens, and every count ends on its step's true result
    assert rows["response"].str.startswith("<think>Given ").all()
    for response in rows["response"][counted]:
        for a, op, b, chain in re.findall(r"([0-9]+) ([-+]) ([0-9]+) = ([0-9 ]+)\.", response):
            counts = [int(x) for x in chain.split()]
            assert counts[-1] == (int(a) + int(b) if op == "+" else int(a) - int(b))
            assert len(counts) == int(b)
    for share in (0.0, 1.0):  # all recall, all count
        only, _ = load_sft_data(DataConfig(num_train=50, num_heldout=0, task=TaskConfig(max_operand=6,
                                                                                          counting_share=share)))
        steps = [step for r in only["response"] for step in re.findall(r"[0-9]+ [-+] ([0-9]+) = ([0-9 ]+)\.", r)]
        assert steps and all(len(chain.split()) == (int(b) if share else 1) for b, chain in steps)
