"""The non-reasoning rows streamed: generated or read a batch at a time into Parquet part files, checked per batch with
the one-line errors of a whole table, and appended by the merge a batch at a time after the reasoning rows; the
curated rows the same as when they were one frame."""

from __future__ import annotations

import json
import re

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from grpo.configs.sampling import GenerationConfig, SamplingConfig
from grpo.data.general import (CATEGORIES, FORMS, REFUSAL, answer_text, chosen_response, general_sft_batches,
                               general_sft_rows)
from grpo.data.tables import DataError
from grpo.rejection.curate import build_heldout_index
from grpo.rejection.merge import merge_shards, write_merged
from grpo.rejection.non_reasoning import (KIND_TYPE, ModelAnswers, answer_pool, appended_rows, appended_tables,
                                         model_answer_batches, right_answer, write_non_reasoning)
from shard_files import CFG, HELDOUT, tiny_shards

N = 30  # non-reasoning rows the config asks for: four batches of 8 (the last of 6)
BATCH = 8


def by_hand(n: int, chat: bool = False) -> list[dict]:
    """The user file's rows: text prompts (as the shards'), or chat messages."""
    return [{"prompt": [{"role": "user", "content": f"Say {i}."}] if chat else f"Say {i}.", "response": f"{i}!"}
            for i in range(n)]


def write_file(rows: list[dict], path) -> str:
    frame = pd.DataFrame(rows)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".parquet":
        frame.to_parquet(path)
    elif path.suffix == ".csv":
        frame.to_csv(path, index=False)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:  # a `datasets` folder
        import datasets

        datasets.Dataset.from_pandas(frame, preserve_index=False).save_to_disk(str(path))
    return str(path)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """tiny_shards (marked), and the reasoning rows the merge keeps of them with no non-reasoning rows asked for."""
    out = tmp_path_factory.mktemp("shards")
    tiny_shards(out, build_heldout_index(HELDOUT, CFG.decontamination_ngram, CFG.decontamination_threshold))
    cfg = CFG.model_copy(update={"non_reasoning_rows": 0, "target_samples": 120})
    reasoning = pq.read_table(write_merged(out, cfg, out / "reasoning-only", HELDOUT, num_shards=5).files)
    return out, reasoning


def curated(shards_dir, non_reasoning, dest, n: int = N) -> tuple[pa.Table, int]:
    """The curated rows `write_merged` writes with `n` non-reasoning rows, and how many it says it appended."""
    cfg = CFG.model_copy(update={"non_reasoning_rows": n, "target_samples": 120 + n})
    merged = write_merged(shards_dir, cfg, dest, HELDOUT, non_reasoning, num_shards=5)
    return pq.read_table(merged.files), merged.non_reasoning


def check_appended(table: pa.Table, reasoning: pa.Table, expected: list[dict]) -> None:
    """`table`: the reasoning rows as without non-reasoning rows, then `expected`, `kind` non_reasoning and every
    other column empty, the text columns of the reasoning rows' type."""
    assert table.column_names == reasoning.column_names
    # (`kind` is text either way; without non-reasoning rows the merge types it `string`, with them as pandas does)
    assert table.slice(0, len(reasoning)).cast(reasoning.schema).equals(reasoning)
    assert table.schema.field("kind").type == KIND_TYPE
    assert [f for f in table.schema if f.name != "kind"] == [f for f in reasoning.schema if f.name != "kind"]
    tail = table.slice(len(reasoning))
    assert tail.column("kind").to_pylist() == ["non_reasoning"] * len(expected)
    assert tail.column("prompt").to_pylist() == [r["prompt"] for r in expected]
    assert tail.column("response").to_pylist() == [r["response"] for r in expected]
    others = [c for c in table.column_names if c not in ("prompt", "response", "kind")]
    assert all(tail.column(c).null_count == len(expected) for c in others)


def test_general_sft_batches_are_general_sft_rows_in_parts():
    whole = general_sft_rows(100, seed=5)
    parts = list(general_sft_batches(100, seed=5, batch_rows=32))
    assert [len(p) for p in parts] == [32, 32, 32, 4]
    pd.testing.assert_frame_equal(pd.concat(parts, ignore_index=True), whole)


def test_the_synthetic_rows_stream_into_the_curated_rows_as_the_generator_makes_them(shards, tmp_path):
    out, reasoning = shards
    files = write_non_reasoning("synthetic", N, 3, tmp_path / "non_reasoning", batch_rows=BATCH)
    metadata = pq.ParquetFile(files[0]).metadata
    # a row group a batch: written as generated, never as one frame
    assert [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)] == [8, 8, 8, 6]
    table, appended = curated(out, tmp_path / "non_reasoning", tmp_path / "curated")
    expected = general_sft_rows(N, 3).to_dict("records")  # the generator's own rows, made here in one call
    check_appended(table, reasoning, expected)
    assert appended == N
    # the merge in memory appends the same rows from the files as from one frame of them
    cfg = CFG.model_copy(update={"non_reasoning_rows": N, "target_samples": 120 + N})
    from_files = merge_shards(out, cfg, HELDOUT, tmp_path / "non_reasoning", num_shards=5).dataset
    from_frame = merge_shards(out, cfg, HELDOUT, general_sft_rows(N, 3), num_shards=5).dataset
    pd.testing.assert_frame_equal(from_files, from_frame)


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.parquet", "rows.json", "rows-dataset"])
def test_a_user_files_first_rows_stream_into_the_curated_rows(shards, tmp_path, name):
    out, reasoning = shards
    rows = by_hand(N + 7)  # more than asked for: the first N are taken
    source = write_file(rows, tmp_path / name)
    write_non_reasoning(source, N, 0, tmp_path / "non_reasoning", batch_rows=BATCH)
    table, appended = curated(out, tmp_path / "non_reasoning", tmp_path / "curated")
    check_appended(table, reasoning, rows[:N])
    assert appended == N


def test_chat_prompts_stay_chat_messages(tmp_path):
    rows = by_hand(N, chat=True)
    source = write_file(rows, tmp_path / "chat.jsonl")
    write_non_reasoning(source, N, 0, tmp_path / "rows", batch_rows=BATCH)
    table = pa.concat_tables(appended_tables(appended_rows(tmp_path / "rows", N), batch_rows=BATCH))
    assert table.column("prompt").to_pylist() == [r["prompt"] for r in rows]
    assert table.column("response").to_pylist() == [r["response"] for r in rows]


def test_a_csv_files_rows_are_text_in_every_batch(shards, tmp_path):
    """A batch of number-like cells stays text, as the whole file read them (a column of text and numbers)."""
    out, reasoning = shards
    rows = [{"prompt": f"Count to {i}.", "response": str(i) if i < BATCH else f"{i}, done."} for i in range(N)]
    source = write_file(rows, tmp_path / "rows.csv")
    write_non_reasoning(source, N, 0, tmp_path / "non_reasoning", batch_rows=BATCH)
    table, _ = curated(out, tmp_path / "non_reasoning", tmp_path / "curated")
    check_appended(table, reasoning, rows)


def test_the_merge_appends_what_it_has_a_batch_at_a_time(tmp_path):
    write_non_reasoning("synthetic", N, 0, tmp_path / "rows", batch_rows=BATCH)
    tables = list(appended_tables(appended_rows(tmp_path / "rows", 20), batch_rows=6))
    assert [len(t) for t in tables] == [6, 6, 6, 2]
    assert appended_rows(tmp_path / "rows", 100).rows == N  # fewer than asked for: all of them, as a frame's head
    assert appended_rows(tmp_path / "rows", 0).rows == 0


def test_a_bad_row_in_a_later_batch_fails_naming_the_file_its_row_and_column(tmp_path):
    rows = by_hand(N)
    rows[21]["response"] = "  "
    source = write_file(rows, tmp_path / "rows.jsonl")
    with pytest.raises(DataError, match=rf"^{re.escape(source)}: row 21, column 'response': expected text, got '  '$"):
        write_non_reasoning(source, N, 0, tmp_path / "out", batch_rows=BATCH)
    del rows[13]["response"]  # a row without the column, in a batch whose other rows have it
    rows[21]["response"] = "21!"
    source = write_file(rows, tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match=rf"^{re.escape(source)}: row 13, column 'response': expected text, got nan$"):
        write_non_reasoning(source, N, 0, tmp_path / "out2", batch_rows=BATCH)
    for row in rows[BATCH:2 * BATCH]:  # a whole batch without it: its cells are empty, as in the whole table
        row.pop("response", None)
    source = write_file(rows, tmp_path / "no-column.jsonl")
    with pytest.raises(DataError, match=rf"^{re.escape(source)}: row 8, column 'response': expected text, got nan$"):
        write_non_reasoning(source, N, 0, tmp_path / "out4", batch_rows=BATCH)
    lines = (tmp_path / "rows.jsonl").read_text().splitlines()
    lines[17] = "{not json"
    (tmp_path / "broken.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"broken\.jsonl: line 18 is not valid JSON"):
        write_non_reasoning(str(tmp_path / "broken.jsonl"), N, 0, tmp_path / "out3", batch_rows=BATCH)


def test_too_few_rows_no_column_or_mixed_kinds_fail_in_one_line(tmp_path):
    source = write_file(by_hand(12), tmp_path / "few.parquet")
    with pytest.raises(DataError, match=rf"^{re.escape(source)}: 12 non-reasoning rows, the recipe asks for {N}$"):
        write_non_reasoning(source, N, 0, tmp_path / "out", batch_rows=BATCH)
    source = write_file([{"prompt": "Hi.", "answer": "Hello!"}] * 3, tmp_path / "answers.jsonl")
    with pytest.raises(DataError, match=r"missing column\(s\) \['response'\]"):
        write_non_reasoning(source, 3, 0, tmp_path / "out2", batch_rows=BATCH)
    # text prompts in the first batch, chat messages in the second: one Parquet column cannot hold both
    rows = [{"prompt": f"Say {i}." if i < BATCH else [{"role": "user", "content": "Hi."}], "response": "ok"}
            for i in range(2 * BATCH)]
    source = write_file(rows, tmp_path / "mixed.jsonl")
    with pytest.raises(DataError, match=rf"^{re.escape(source)}: rows 8 to 15, column 'prompt': list<.*where the rows before "
                                        r"hold large_string"):
        write_non_reasoning(source, 2 * BATCH, 0, tmp_path / "out3", batch_rows=BATCH)


def test_rows_past_the_ones_taken_are_not_read(tmp_path):
    source = write_file(by_hand(N), tmp_path / "rows.jsonl")
    lines = (tmp_path / "rows.jsonl").read_text().splitlines()
    lines[25] = "{not json"  # past the 20 rows taken: never read, so never an error
    (tmp_path / "rows.jsonl").write_text("\n".join(lines) + "\n")
    files = write_non_reasoning(source, 20, 0, tmp_path / "out", batch_rows=BATCH)
    assert pq.read_table(files).column("prompt").to_pylist() == [f"Say {i}." for i in range(20)]


@pytest.fixture(scope="module")
def taught(tmp_path_factory):
    """A tiny model taught, in plain words as an instruct model answers, the right answers of the first requests the
    `model` source asks (a refusal for a harmful one), each followed by a fragment a budget cut mid-sentence; and
    its engine."""
    from grpo.configs.model import ModelConfig
    from grpo.configs.training import SFTConfig
    from grpo.models import load_model_and_tokenizer
    from grpo.sampling.engines import build_engine
    from grpo.training.loops.sft_trainer import train_sft
    from tiny_configs import TINY_MODEL

    torch.manual_seed(0)
    first = answer_pool(0)[:8]
    model, tok = load_model_and_tokenizer(ModelConfig(tiny=TINY_MODEL))
    rows = pd.DataFrame({"prompt": [p.text for p in first],
                         "response": [f"{answer_text(chosen_response(p))} And then" for p in first]})
    out = tmp_path_factory.mktemp("taught")
    train_sft(model, tok, rows, SFTConfig(max_steps=150, batch_size=8, learning_rate=5e-3, warmup_steps=2,
                                          mixed_precision="no", checkpoint_every=0), out, progress=False)
    model, tok = load_model_and_tokenizer(ModelConfig(name_or_path=str(out / "model")))
    return first, build_engine(GenerationConfig(), model.eval(), tok)


def test_the_model_source_keeps_each_requests_first_right_answer_cut_to_whole_sentences(taught):
    first, engine = taught
    answers = ModelAnswers(engine, 2, SamplingConfig(temperature=0.0, max_new_tokens=48))
    frames = list(model_answer_batches(answers, 5, seed=0, requests_per_batch=4, max_requests=8))
    rows = pd.concat(frames, ignore_index=True)
    assert [len(f) for f in frames] == [4, 1]  # a batch of requests at a time, stopped at the rows asked for
    assert list(rows["prompt"]) == [p.text for p in first[:5]]
    assert list(rows["response"]) == [f"<think>{FORMS[p.form][4].format(p.subject)}</think><answer>"
                                      f"{answer_text(chosen_response(p))}</answer>" for p in first[:5]]  # cut
    assert {p.category for p in first} == set(CATEGORIES)  # the harmful ones among them refused, in its words
    # an answer that does not handle its request right is no row: the reference's safe alternative alone, to a
    # harmful request, is not a refusal
    [harmful] = [p for p in first if p.category == "harmful"][:1]
    assert right_answer(harmful.reference, harmful) is None and right_answer(REFUSAL, harmful) == REFUSAL


def test_a_model_that_answers_too_few_helpfully_gives_what_it_has_with_a_line_and_none_fails(taught, caplog,
                                                                                          answering_checkpoint):
    from grpo.configs.model import ModelConfig
    from grpo.models import load_model_and_tokenizer
    from grpo.sampling.engines import build_engine

    _, engine = taught
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=48)
    with caplog.at_level("WARNING", logger="grpo.rejection.non_reasoning"):
        rows = pd.concat(model_answer_batches(ModelAnswers(engine, 1, greedy), 50, seed=0, max_requests=12))
    # the taught eight, and any other of the twelve its words happen to answer (a subject taught under another lead-in)
    assert {p.text for p in taught[0]} <= set(rows["prompt"]) and len(rows) <= 12
    assert f"handled {len(rows)} of the 12 general requests right: {len(rows)} non-reasoning rows of the 50" \
        in caplog.text
    model, tok = load_model_and_tokenizer(ModelConfig(name_or_path=answering_checkpoint))  # says <answer>1</answer>
    ones = ModelAnswers(build_engine(GenerationConfig(), model.eval(), tok), 1, greedy)
    with pytest.raises(DataError, match="handled none of the first 4 general requests right"):
        list(model_answer_batches(ones, 5, seed=0, max_requests=4))
    # a model that gets none right stops after the first batches, not after sampling the whole pool
    with pytest.raises(DataError, match="handled none of the first 128 general requests right"):
        list(model_answer_batches(ones, 5, seed=0))
