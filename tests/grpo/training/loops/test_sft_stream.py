"""SFT from a stream: the curated dataset's Parquet part files (and an older run's single file) tokenized once into
Arrow files give the loop exactly the batches today's in-memory frame gives it, holding a bounded part of them; the
processes of a launch (real ones, gloo on 127.0.0.1) tokenize it once between them."""

import multiprocessing as mp
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo.configs.training import SFTConfig
from grpo.data.row_files import check_row_files
from grpo.data.tables import SFT_SCHEMA, DataError
from grpo.models import load_model_and_tokenizer, load_tokenizer
from grpo.sampling.local import render_prompts, response_text
from grpo.training.batches import batch_indices
from grpo.training.loops.sft_trainer import collate, tokenize_rows, train_sft
from grpo.training.sft_rows import TokenizedRows, row_share, text_runs, tokenize_files
from tiny_configs import SMALL

# reasoning rows with text prompts, as the merge writes them
CURATED = pd.DataFrame({"prompt": [f"What is {i} + {i % 7}?" for i in range(21)],
                        "response": [f"<think>{i} + {i % 7} = {2 * i % 50}.</think><answer>{i + i % 7}</answer>"
                                     for i in range(21)],
                        "kind": "reasoning"})
# cold-start rows with chat-message prompts, as an older run's single data.parquet
COLD = pd.DataFrame({"prompt": [[{"role": "user", "content": f"Double {i}."}] for i in range(6)],
                     "response": [f"<think>{i} x 2</think><answer>{2 * i}</answer>" for i in range(6)]})


def one_call_a_row(rows: pd.DataFrame, tok, max_seq_len: int) -> list[tuple[list[int], list[int]]]:
    """The tokens as the loop made them before the stream: the tokenizer called on each row's prompt and response."""
    out = []
    for cell, prompt, response in zip(rows["prompt"], render_prompts(tok, rows["prompt"].tolist()), rows["response"]):
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        r = tok(response_text(tok, cell, prompt, response), add_special_tokens=False)["input_ids"]
        out.append(((p + r)[:max_seq_len], ([-100] * len(p) + r)[:max_seq_len]))
    return out


def write_parts(frame: pd.DataFrame, folder, rows_per_file: int) -> None:
    """The frame as write_merged lays a dataset out: part-00000.parquet, part-00001.parquet, ..."""
    folder.mkdir(parents=True)
    table = pa.Table.from_pandas(frame, preserve_index=False)
    for k, start in enumerate(range(0, len(frame), rows_per_file)):
        pq.write_table(table.slice(start, rows_per_file), folder / f"part-{k:05d}.parquet")


@pytest.fixture()
def datasets(tmp_path):
    write_parts(CURATED, tmp_path / "curated", 8)  # 3 part files
    (tmp_path / "cold").mkdir()
    COLD.to_parquet(tmp_path / "cold" / "data.parquet")  # what log_frame wrote
    return [tmp_path / "curated", tmp_path / "cold"]


def test_the_stream_gives_the_frames_batches(datasets, tmp_path):
    _, tok = load_model_and_tokenizer(SMALL)
    # today's path: both datasets read whole into one frame, concatenated, tokenized in memory
    frame = pd.concat([pd.read_parquet(d)[["prompt", "response"]] for d in datasets], ignore_index=True)
    expected = tokenize_rows(frame, tok, 64)
    assert [tuple(e) for e in expected] == one_call_a_row(frame, tok, 64)
    streamed = tokenize_files(datasets, tok, 64, tmp_path / "tokens", batch_rows=5)  # batches across files
    assert len(streamed) == len(expected) == 27
    assert [streamed[i] for i in range(len(streamed))] == expected
    assert streamed.label_tokens.tolist() == [sum(t != -100 for t in e.labels[1:]) for e in expected]
    for step in range(12):  # two epochs of batches of 4
        idx = batch_indices(len(expected), 4, step, seed=3)
        a, b = collate([expected[i] for i in idx], 0), collate([streamed[i] for i in idx], 0)
        assert all(torch.equal(a[k], b[k]) for k in a)
    # tokenized once: a second call maps the same file
    (cache,) = (tmp_path / "tokens").glob("tokens-*.arrow")
    mtime = cache.stat().st_mtime_ns
    assert tokenize_files(datasets, tok, 64, tmp_path / "tokens")[26] == expected[26]
    assert cache.stat().st_mtime_ns == mtime and len(list((tmp_path / "tokens").iterdir())) == 1


def test_training_from_files_ends_at_the_frames_weights(datasets, tmp_path):
    cfg = SFTConfig(max_steps=2, batch_size=4, learning_rate=3e-3, warmup_steps=1, log_every=1, checkpoint_every=0,
                    mixed_precision="no", max_seq_len=64)
    frame = pd.concat([pd.read_parquet(d)[["prompt", "response"]] for d in datasets], ignore_index=True)
    losses = {}
    for name, rows in (("frame", frame), ("files", [str(d) for d in datasets])):
        model, tok = load_model_and_tokenizer(SMALL)
        result = train_sft(model, tok, rows, cfg, tmp_path / name, lambda s, m: losses.setdefault(name, []).append(
            m["train/loss"]), progress=False)
        losses[name + "_dir"] = result.model_dir
    assert losses["frame"] == losses["files"]
    a = AutoModelForCausalLM.from_pretrained(losses["frame_dir"]).state_dict()
    b = AutoModelForCausalLM.from_pretrained(losses["files_dir"]).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_bad_row_in_a_part_file_fails_in_one_line_naming_it(tmp_path):
    bad = CURATED.copy()
    bad.loc[19, "response"] = None  # row 3 of part-00002 (8 rows a file)
    write_parts(bad, tmp_path / "curated", 8)
    with pytest.raises(DataError) as e:
        check_row_files(tmp_path / "curated", SFT_SCHEMA, "runs:/abc/dataset/curated", batch_rows=2)
    # one line: the file, its row and column (pandas shows the empty cell as None or nan, by its version)
    assert str(e.value) in (f"runs:/abc/dataset/curated/part-00002.parquet: row 3, column 'response': expected text, "
                            f"got {empty}" for empty in ("None", "nan"))
    write_parts(CURATED.drop(columns="response"), tmp_path / "no_response", 30)
    with pytest.raises(DataError, match=r"no_response/part-00000.parquet: missing column\(s\) \['response'\]"):
        check_row_files(tmp_path / "no_response", SFT_SCHEMA, str(tmp_path / "no_response"))


def test_a_prompt_too_long_names_its_file_and_row(tmp_path):
    _, tok = load_model_and_tokenizer(SMALL)
    long = CURATED.copy()
    long.loc[10, "prompt"] = "What is " + " + ".join(["1"] * 80) + "?"  # row 2 of part-00001
    write_parts(long, tmp_path / "curated", 8)
    with pytest.raises(DataError, match=r"^curated \(part-00001.parquet\): row 2, column 'prompt': \d+ tokens"):
        tokenize_files([tmp_path / "curated"], tok, 64, tmp_path / "tokens", source="curated")
    assert not list((tmp_path / "tokens").iterdir())  # nothing half-written is left to be mapped later


def test_an_older_runs_single_file_is_still_read(datasets, tmp_path):
    _, tok = load_model_and_tokenizer(SMALL)
    older = datasets[1] / "data.parquet"
    for path in (datasets[1], older):  # the artifact folder, or the file itself
        described = check_row_files(path, SFT_SCHEMA, "runs:/old/dataset/curated")
        assert described.rows == 6 and described.files == [older]
        assert described.schema["prompt"].startswith("list<")
        assert list(tokenize_files([path], tok, 64, tmp_path / "tokens")) == tokenize_rows(pd.read_parquet(older),
                                                                                          tok, 64)


def test_text_runs_cut_rows_in_order_within_the_budget():
    rng = np.random.default_rng(0)
    for _ in range(200):
        chars, budget = rng.integers(1, 50, size=rng.integers(0, 30)).tolist(), int(rng.integers(1, 120))
        runs = text_runs(chars, budget)
        assert [i for r in runs for i in range(len(chars))[r]] == list(range(len(chars)))  # every row once, in order
        assert all(sum(chars[r]) <= budget or r.stop - r.start == 1 for r in runs)
        # next-fit: a run closes only when its next row would pass the budget
        assert all(sum(chars[a]) + chars[b.start] > budget for a, b in zip(runs, runs[1:]))


def test_tokenizing_holds_a_calls_text_and_reading_holds_the_rows_asked_for(datasets, tmp_path):
    _, tok = load_model_and_tokenizer(SMALL)
    frame = pd.concat([pd.read_parquet(d)[["prompt", "response"]] for d in datasets], ignore_index=True)
    expected = tokenize_rows(frame, tok, 64)
    # a budget under any row's text: one tokenizer call a row, each its own record batch in the token file
    one = tokenize_files(datasets, tok, 64, tmp_path / "one", max_chars=1)
    assert np.diff(one.places.first).tolist() == [1] * 27 and list(one) == expected
    # 130 characters: two curated rows a call, one cold-start row (text_runs), none past the budget with two or more
    some = tokenize_files(datasets, tok, 64, tmp_path / "some", batch_rows=5, max_chars=130)
    chars = [len(str(p)) + len(r) for p, r in zip(frame["prompt"], frame["response"])]
    # read 5 rows at a time from each file: part files of 8, 8 and 5 rows, then the older run's 6
    frames = ((0, 5), (5, 8), (8, 13), (13, 16), (16, 21), (21, 26), (26, 27))
    runs = [text_runs(chars[a:b], 130) for a, b in frames]
    assert np.diff(some.places.first).tolist() == [r.stop - r.start for rs in runs for r in rs] \
        == [2, 2, 1, 2, 1] * 2 + [2, 2, 1] + [1] * 6
    assert list(some) == expected
    # what a reader holds: 16 bytes a row (token counts, place in the file), 28 a record batch, none of the file mapped
    assert sum(a.nbytes for a in some.places) == 16 * 27 + 8 * (1 + 3 * len(some.places.ids_at)) + 4 * len(
        some.places.ids_at)
    if sys.platform == "linux":
        maps = open("/proc/self/maps").read()
        assert not any(str(f) in maps for f in (tmp_path / "some").glob("tokens-*.arrow"))


def _one_of_two(rank: int, folder, how: str, wait_s: float, store, queue) -> None:
    """Process `rank` of a two-process launch tokenizing `folder/curated`, its place told by a process group
    (`how="group"`) or by the launcher's environment alone (`how="env"`, as `accelerate launch` starts the loop); its
    rows and the rows it tokenized, or its error, on `queue`."""
    import torch.distributed as dist

    if how == "group":
        # a file rendezvous: no port another process could take between choosing it and binding it
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    else:
        os.environ.update(RANK=str(rank), WORLD_SIZE="2")
    try:
        rows = tokenize_files([folder / "curated"], load_tokenizer(SMALL), 64, folder / "tokens", source="curated",
                              batch_rows=2, wait_s=wait_s)
        queue.put((rank, list(rows), rows.tokenized))
    except Exception as e:
        queue.put((rank, f"{type(e).__name__}: {e}", None))
    if dist.is_initialized():
        dist.destroy_process_group()


def two_processes(folder, how: str, wait_s: float = 120) -> dict[int, tuple]:
    """What each of two spawned processes tokenizing `folder/curated` reported, by rank (each waiting at most
    `wait_s` for the other's part)."""
    ctx, store = mp.get_context("spawn"), Path(tempfile.mkdtemp(dir=folder)) / "rendezvous"
    queue = ctx.Queue()
    procs = [ctx.Process(target=_one_of_two, args=(rank, folder, how, wait_s, store, queue)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    reports = dict((r[0], r[1:]) for r in (queue.get(timeout=180) for _ in procs))
    for proc in procs:
        proc.join(60)
    return reports


def test_row_share_splits_the_rows_in_order_across_the_files():
    counts = [8, 8, 5]
    for ranks in (1, 2, 3, 4, 30):
        shares = [row_share(counts, r, ranks) for r in range(ranks)]
        # every row once, in the order of one table: rank r's rows follow rank r-1's
        rows = [(k, i) for share in shares for k, a, b in share for i in range(a, b)]
        assert rows == [(k, i) for k, n in enumerate(counts) for i in range(n)]
        assert max(sum(b - a for _, a, b in s) for s in shares) - min(sum(b - a for _, a, b in s) for s in shares) <= 1
    assert row_share(counts, 1, 2) == [(1, 2, 8), (2, 0, 5)]  # rows 10..20 of 21


@pytest.mark.parametrize("how", ["group", "env"])
def test_two_processes_tokenize_half_each_and_read_the_whole_as_one_process_does(tmp_path, how):
    write_parts(CURATED, tmp_path / "curated", 8)  # 21 rows: rank 0 takes rows 0-9, rank 1 rows 10-20
    expected = tokenize_rows(CURATED, load_tokenizer(SMALL), 64)
    reports = two_processes(tmp_path, how)
    assert all(isinstance(reports[r][0], list) for r in (0, 1)), reports
    # both read every row, each the example one process makes of it in memory
    assert reports[0][0] == reports[1][0] == expected
    # each tokenized only its share, into a part file of its own, nothing else left there
    assert [reports[r][1] for r in (0, 1)] == [10, 11]
    parts = sorted((tmp_path / "tokens").iterdir())
    assert [p.name.split("-", 2)[2] for p in parts] == ["0-of-2.arrow", "1-of-2.arrow"]
    assert [list(TokenizedRows(p)) for p in parts] == [expected[:10], expected[10:]]
    # a rerun (a resumed launch) finds the parts and tokenizes nothing
    written = [p.stat().st_mtime_ns for p in parts]
    again = two_processes(tmp_path, how)
    assert again == {0: (expected, 0), 1: (expected, 0)}
    assert [p.stat().st_mtime_ns for p in parts] == written and sorted((tmp_path / "tokens").iterdir()) == parts


def test_a_prompt_too_long_in_the_second_share_names_its_file_and_dataset_row(tmp_path):
    long = CURATED.copy()
    long.loc[12, "prompt"] = "What is " + " + ".join(["1"] * 80) + "?"  # row 4 of part-00001, in rank 1's share
    write_parts(long, tmp_path / "curated", 8)
    reports = two_processes(tmp_path, "env", wait_s=3)
    assert reports[1][0].startswith("DataError: curated (part-00001.parquet): row 4, column 'prompt': ")
    # the other wrote its share and waited for the part that never came, then named it
    (part,) = (tmp_path / "tokens").iterdir()  # nothing half-written beside it
    assert part.name.endswith("-0-of-2.arrow") and len(TokenizedRows(part)) == 10
    missing = part.name.replace("-0-of-2", "-1-of-2")
    assert reports[0][0].startswith(f"TimeoutError: {tmp_path / 'tokens' / missing}: process 1 of 2 wrote no "
                                    f"tokens within 3 s")
