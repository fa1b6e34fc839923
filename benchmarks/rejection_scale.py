"""The rejection-sampling merge at scale: synthetic shards of kept rows with ~4 KB responses, merged in a fresh
process per size; rows a second, MiB of text a second and the merge's peak RSS growth.

    PYTHONPATH=. .venv/bin/python benchmarks/rejection_scale.py --rows 20000 80000
    PYTHONPATH=. .venv/bin/python benchmarks/rejection_scale.py --rows 800000 --ways write_merged

Each size's shards are written first (with the shard task's marks where the code has them, timed apart: that work
runs in the shard tasks, in parallel, beside sampling). Then, each in its own process: `merge_shards` (the dataset
in memory), where the code has it `write_merged` (streamed to Parquet), and where the code has that too, one pass of
SFT's data loading over `write_merged`'s part files: tokenized into the Arrow token file (the tiny recipe's
tokenizer, max_seq_len 4096), then every batch of 16 of one epoch taken as the loop takes them (`batch_indices`,
`collate`), each row read from the file; with `--processes N` in N processes at once, as a launch's (RANK and
WORLD_SIZE set, as `accelerate launch` sets them), each printing its own line. `--ways` picks some of the three. With
`--unmarked` the shards are written without marks, as older code wrote them, and the merge does all the curation on
its one core. Rows: 4 samples per prompt, 1% of them repeated in a later shard (case changed), 0.5% quoting a
held-out prompt; held-out set of `--heldout` problems; target 90% of the rows. Run against older code by pointing
PYTHONPATH at its checkout.
The CPU (lscpu) and the load average before and after each merge are printed: on a shared machine, read the figures
with it.

`--ways non_reasoning` measures the non-reasoning rows instead, `--rows` of them (R1: 200,000): a user file of
`--rows` (prompt, response) rows of the same size (`--non-reasoning-format`: Parquet, as recipes/r1-800k.yaml names
one, or JSONL), then in a fresh process the stage's two steps: the rows read, checked and written to Parquet part
files a batch at a time (`write_non_reasoning`), then `write_merged` appending them after 2,000 reasoning rows of
shards; each step's time and peak RSS growth. Against older code (no `write_non_reasoning`) it runs that code's
steps instead: the file read whole (`read_table`), checked (`validate_rows`), written as one Parquet file and read
back as one frame, which `write_merged` appended.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/rejection_scale.py --rows 20000 200000 --ways non_reasoning
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd


def cpu() -> str:
    """lscpu's model name, family and model, and whether the CPU computes bf16 (avx512_bf16)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown CPU"
    info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    get = lambda k: info.get(k, "?").strip()  # noqa: E731
    bf16 = "avx512_bf16" in get("Flags").split()
    return (f"{get('Model name')} (family {get('CPU family')}, model {get('Model')}; "
            f"{'avx512_bf16' if bf16 else 'no avx512_bf16'}; {os.cpu_count()} CPUs)")


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def rss_kib(reset_peak: bool = False, peak: bool = False) -> int:
    """This process's resident set (VmRSS), or its peak since the last reset (VmHWM; Linux, else ru_maxrss)."""
    try:
        if reset_peak:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
        fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return int(fields["VmHWM" if peak else "VmRSS"].split()[0])
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def rss_anon_kib() -> int:
    """This process's anonymous resident memory (RssAnon: not the pages of mapped files, which the kernel can drop)."""
    try:
        return int(dict(line.split(":", 1) for line in open("/proc/self/status"))["RssAnon"].split()[0])
    except (OSError, KeyError):
        return 0


def config(rows: int):
    from grpo.configs.rejection import RejectionConfig

    return RejectionConfig(target_samples=int(rows * 0.9), decontamination_ngram=8, decontamination_threshold=0.8)


def heldout(n: int) -> list[str]:
    from grpo.configs.data import TaskConfig
    from grpo.data.arithmetic import generate_problems

    return [p.question for p in generate_problems(TaskConfig(), n, "heldout")]


def write_shards(out: Path, rows: int, shard_rows: int, response_bytes: int, n_heldout: int,
                 unmarked: bool = False) -> dict:
    """Synthetic kept rows as shard files; returns the text written and the time spent marking rows."""
    from grpo.rejection import curate as curation
    from grpo.rejection.filters import Counts
    from grpo.rejection.shards import write_shard

    cfg, held = config(rows), heldout(n_heldout)
    marking = hasattr(curation, "mark_rows") and not unmarked  # the shard task's marks, where this code has them
    index = curation.build_heldout_index(held, 8, 0.8) if marking else None
    rng = np.random.default_rng(0)
    vocab = np.array([f"w{i:x}" for i in range(20000)] + ["add", "the", "hens", "eggs", "apples", "so"])
    words_per_row = response_bytes // 6
    text_bytes, mark_s, earlier = 0, 0.0, []
    for s, start in enumerate(range(0, rows, shard_rows)):
        n = min(shard_rows, rows - start)
        ids = np.arange(start, start + n)
        pid = ids // 4
        prompts = [f"Problem {p}: a farmer has {p % 97} hens and {p % 13} more. How many in all?" for p in pid]
        picks = rng.integers(len(vocab), size=(n, words_per_row))
        responses = [f"<think>{' '.join(vocab[r])}</think><answer>{k}</answer>" for k, r in zip(ids, picks)]
        for i in np.flatnonzero(rng.random(n) < 0.005):  # a response quoting a held-out problem
            responses[i] = responses[i].replace("<think>", f"<think>{held[i % len(held)]} ", 1)
        if earlier:  # 1% repeat an earlier shard's row (case changed): a duplicate across shards
            for i in np.flatnonzero(rng.random(n) < 0.01):
                prompts[i], responses[i] = earlier[i % len(earlier)]
        earlier = [(p, r.upper().replace("<THINK>", "<think>").replace("</THINK>", "</think>")
                    .replace("<ANSWER>", "<answer>").replace("</ANSWER>", "</answer>"))
                   for p, r in zip(prompts[:50], responses[:50])]
        kept = pd.DataFrame({"prompt": prompts, "response": responses, "answer": [str(i) for i in ids],
                             "source_prompt_id": pid, "sample_index": ids % 4, "completion_tokens": 1000,
                             "verdict_source": "rule", "judge_accepted": None, "judge_rationale": ""})
        text_bytes += sum(len(p.encode()) + len(r.encode()) for p, r in zip(prompts, responses))
        result = curation.ShardResult(kept, None, Counts.zero(cfg)._replace(generated=n, kept=n))
        if marking:
            t = time.perf_counter()
            result = result._replace(marks=curation.mark_rows(kept, index))
            mark_s += time.perf_counter() - t
        write_shard(result, out, s)
    return {"text_bytes": text_bytes, "mark_s": mark_s if marking else None}


def child(how: str, out: str, rows: int, n_heldout: int, batch_rows: int) -> None:
    """One merge in this process; prints a JSON line with its time and peak RSS growth."""
    from grpo.rejection import shards

    merged = getattr(shards, "write_merged", None)
    cfg, held = config(rows), heldout(n_heldout)
    if "merge_batch_rows" in type(cfg).model_fields:
        cfg = cfg.model_copy(update={"merge_batch_rows": batch_rows})
    if how == "sft_loading":
        sft_loading(out)
        return
    if how == "sft_reading":
        sft_reading(out, rows)
        return
    if how == "non_reasoning":
        non_reasoning(out, rows, batch_rows)
        return
    base = rss_kib(reset_peak=True)  # after the imports, whose own peak does not count
    t = time.perf_counter()
    nodes = None
    if how == "merge_shards":
        result = shards.merge_shards(out, cfg, held)
        kept = len(result.dataset)
    elif how == "write_merged_ray":  # the reads on the cluster's nodes (Ray Data), decided and written here
        import ray

        from grpo.rejection.ray_reader import RayDataReader

        reader = RayDataReader()
        ray.init(address=os.environ["R1_BENCH_RAY"], log_to_driver=False)
        base = rss_kib(reset_peak=True)  # after connecting: Ray's own threads and buffers do not count
        t = time.perf_counter()
        result = merged(out, cfg, f"{out}/curated", held, reader=reader)
        kept, nodes = result.rows, {node[:8]: n for node, n in reader.nodes.items()}
    else:
        result = merged(out, cfg, f"{out}/curated", held)
        kept = result.rows
    seconds = time.perf_counter() - t
    peak = rss_kib(peak=True)
    print(json.dumps({"seconds": seconds, "rss_growth_mib": (peak - base) / 1024, "kept": kept, "nodes": nodes,
                      "dropped": {k: v for k, v in result.counts.dropped.items()
                                  if k in ("duplicate_across_shards", "contaminated", "over_target")}}))


REASONING_ROWS = 2000  # the shards' rows the non-reasoning rows follow in `--ways non_reasoning`


def write_non_reasoning_file(path: Path, rows: int, response_bytes: int) -> int:
    """A user file of `rows` (prompt, response) rows with ~`response_bytes` responses, written a chunk at a time;
    returns the text written (bytes)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(1)
    vocab = np.array([f"v{i:x}" for i in range(20000)] + ["write", "a", "poem", "about", "the", "sea"])
    text_bytes, writer = 0, None
    try:
        for start in range(0, rows, 2000):
            n = min(2000, rows - start)
            prompts = [f"Request {i}: write a short note about topic {i % 997}." for i in range(start, start + n)]
            picks = rng.integers(len(vocab), size=(n, response_bytes // 6))
            responses = [" ".join(vocab[r]) for r in picks]
            text_bytes += sum(len(p.encode()) + len(r.encode()) for p, r in zip(prompts, responses))
            if path.suffix == ".jsonl":
                with open(path, "a") as f:
                    f.writelines(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in zip(prompts, responses))
                continue
            table = pa.table({"prompt": prompts, "response": responses})
            writer = writer or pq.ParquetWriter(path, table.schema)
            writer.write_table(table)
    finally:
        if writer is not None:
            writer.close()
    return text_bytes


def non_reasoning(out: str, rows: int, batch_rows: int) -> None:
    """The stage's two steps for `rows` non-reasoning rows, in this process: written to part files, then appended
    by the merge; each step's seconds and peak RSS growth (its own peak: reset between them)."""
    from grpo.rejection.shards import write_merged

    source = next(p for p in Path(out).glob("non_reasoning.*") if p.suffix in (".parquet", ".jsonl"))
    cfg = config(REASONING_ROWS).model_copy(update={"merge_batch_rows": batch_rows, "non_reasoning_rows": rows,
                                                    "target_samples": int(REASONING_ROWS * 0.9) + rows})
    held = heldout(500)
    base = rss_kib(reset_peak=True)
    t = time.perf_counter()
    try:
        from grpo.rejection.non_reasoning import write_non_reasoning
    except ImportError:  # the code before: read whole, checked, one Parquet file, read back as one frame
        from grpo.data.tables import read_table, validate_rows

        frame = validate_rows(read_table(str(source)), {"prompt": "text or chat messages", "response": "text"},
                              str(source)).iloc[:rows].reset_index(drop=True)
        frame.to_parquet(f"{out}/non_reasoning-frame.parquet")
        del frame
        how = "one frame"
        write_s, write_peak = time.perf_counter() - t, rss_kib(peak=True) - base
        base = rss_kib(reset_peak=True)
        t = time.perf_counter()
        given = pd.read_parquet(f"{out}/non_reasoning-frame.parquet")
    else:
        write_non_reasoning(str(source), rows, 0, f"{out}/non_reasoning-parts", batch_rows=batch_rows)
        how = "streamed"
        write_s, write_peak = time.perf_counter() - t, rss_kib(peak=True) - base
        base = rss_kib(reset_peak=True)
        t = time.perf_counter()
        given = f"{out}/non_reasoning-parts"
    result = write_merged(f"{out}/shards", cfg, f"{out}/curated", held, given)
    merge_s, merge_peak = time.perf_counter() - t, rss_kib(peak=True) - base
    print(json.dumps({"how": how, "write_s": write_s, "write_growth_mib": write_peak / 1024, "merge_s": merge_s,
                      "merge_growth_mib": merge_peak / 1024, "appended": result.non_reasoning,
                      "rows": result.rows}))


def sft_loading(out: str, max_seq_len: int = 4096, batch_size: int = 16) -> None:
    """SFT's data loading over the merged part files, in this process: tokenize once (as the loop does), then one
    epoch of batches."""
    from grpo.configs.model import ModelConfig
    from grpo.models import load_tokenizer
    from grpo.training.sft_rows import tokenize_files

    tok = load_tokenizer(ModelConfig())
    base, anon = rss_kib(reset_peak=True), rss_anon_kib()
    t, cpu_t = time.perf_counter(), time.process_time()
    examples = tokenize_files([f"{out}/curated"], tok, max_seq_len, f"{out}/tokens", "curated")
    tokenize_s, tokenize_cpu_s = time.perf_counter() - t, time.process_time() - cpu_t
    iterate_s, tokens = one_epoch(examples, batch_size)
    print(json.dumps({"seconds": tokenize_s + iterate_s, "tokenize_s": tokenize_s, "tokenize_cpu_s": tokenize_cpu_s,
                      "iterate_s": iterate_s,
                      "tokenized": getattr(examples, "tokenized", None),  # rows this process tokenized
                      "rss_growth_mib": (rss_kib(peak=True) - base) / 1024, "kept": len(examples),
                      "anon_growth_mib": (rss_anon_kib() - anon) / 1024,
                      "tokens": tokens, "dropped": {}}))


def one_epoch(examples, batch_size: int) -> tuple[float, int]:
    """Every batch of one epoch taken as the loop takes them; the seconds and the tokens."""
    from grpo.training.batches import batch_indices
    from grpo.training.loops.sft_trainer import collate

    t, tokens = time.perf_counter(), 0
    for step in range(len(examples) // batch_size):
        batch = collate([examples[i] for i in batch_indices(len(examples), batch_size, step, 0)], 0)
        tokens += int(batch["attention_mask"].sum())
    return time.perf_counter() - t, tokens


def sft_reading(out: str, rows: int, batch_size: int = 16) -> None:
    """The reading side of SFT's loading alone, at sizes whose tokenizing a shared machine cannot wait for: a token
    file of `rows` rows of 2,000-4,000 random tokens (written first, not timed, as `tokenize_files` lays it out),
    then every row of one epoch's batches read from it, as the loop asks for them (not collated: that costs the
    same a batch at any size)."""
    import pyarrow as pa

    from grpo.training.batches import batch_indices
    from grpo.training.sft_rows import SCHEMA, TokenizedRows

    Path(out).mkdir(parents=True, exist_ok=True)
    path, rng = f"{out}/tokens-synthetic.arrow", np.random.default_rng(0)
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, SCHEMA) as writer:
        for start in range(0, rows, 128):
            lengths = rng.integers(2000, 4001, size=min(128, rows - start)).astype(np.int32)
            offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
            ids = rng.integers(3, 1024, size=int(lengths.sum())).astype(np.int32)
            labels = ids.copy()
            labels[(offsets.to_numpy()[:-1, None] + np.arange(40)).ravel()] = -100  # a 40-token prompt
            writer.write_batch(pa.record_batch([pa.ListArray.from_arrays(offsets, pa.array(ids)),
                                                pa.ListArray.from_arrays(offsets, pa.array(labels)),
                                                pa.array(lengths), pa.array(lengths - 40)], schema=SCHEMA))
    base, anon = rss_kib(reset_peak=True), rss_anon_kib()
    examples = TokenizedRows(path)
    t, tokens = time.perf_counter(), 0
    for step in range(len(examples) // batch_size):
        tokens += sum(len(examples[i].input_ids) for i in batch_indices(len(examples), batch_size, step, 0))
    iterate_s = time.perf_counter() - t
    print(json.dumps({"seconds": iterate_s, "rss_growth_mib": (rss_kib(peak=True) - base) / 1024,
                      "anon_growth_mib": (rss_anon_kib() - anon) / 1024, "kept": len(examples), "tokens": tokens,
                      "file_mib": os.path.getsize(path) / 2**20}))
    os.unlink(path)


def run_way(how: str, out: Path, rows: int, args: argparse.Namespace, mib: float) -> None:
    """One way in a fresh process (single-threaded; sft_loading in `args.processes` at once); prints its lines."""
    before = load()
    cmd = [sys.executable, __file__, "--child", how, str(out), "--rows", str(rows),
           "--heldout", str(args.heldout), "--batch-rows", str(args.batch_rows)]
    n = args.processes if how == "sft_loading" else 1
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t = time.perf_counter()
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**env, "RANK": str(k), "WORLD_SIZE": str(n)} if n > 1 else env) for k in range(n)]
    for k, (proc, (stdout, stderr)) in enumerate(zip(procs, [p.communicate() for p in procs])):
        if proc.returncode:
            sys.exit(f"{how} failed:\n{stderr}")
        print_way(how if n == 1 else f"{how} {k}/{n}", json.loads(stdout.strip().splitlines()[-1]), rows, mib, before)
    if n > 1:
        print(f"  {n} processes: {time.perf_counter() - t:.1f} s from their start to the last one's end")


def print_way(how: str, r: dict, rows: int, mib: float, before: str) -> None:
    if how.startswith("sft_loading"):
        tokenized = "" if r.get("tokenized") is None else f", {r['tokenized']:,} rows of them here"
        print(f"  {how:13s} {r['seconds']:7.1f} s  {r['kept'] / r['seconds']:9,.0f} rows/s  "
              f"peak RSS +{r['rss_growth_mib']:,.0f} MiB (anonymous +{r['anon_growth_mib']:,.0f} MiB at the end)  "
              f"tokenize {r['tokenize_s']:.1f} s ({r['kept'] / r['tokenize_s']:,.0f} rows/s{tokenized}; "
              f"{r['tokenize_cpu_s']:.1f} s of CPU), one epoch "
              f"of batches {r['iterate_s']:.1f} s ({r['kept'] / r['iterate_s']:,.0f} rows/s, "
              f"{r['tokens'] / r['iterate_s'] / 1e6:.1f} M tokens/s)  load {before} -> {load()}")
    elif how == "non_reasoning":
        written = "read, checked, written" if r["how"] == "streamed" else "read whole, checked, written as one file"
        print(f"  {how} ({r['how']}): {written} {r['write_s']:6.1f} s  "
              f"{rows / r['write_s']:9,.0f} rows/s  {mib / r['write_s']:6.1f} MiB/s  peak RSS "
              f"+{r['write_growth_mib']:,.0f} MiB; appended by the merge after {REASONING_ROWS:,} reasoning rows "
              f"{r['merge_s']:6.1f} s  peak RSS +{r['merge_growth_mib']:,.0f} MiB  ({r['appended']:,} appended, "
              f"{r['rows']:,} rows in all)  load {before} -> {load()}")
    elif how == "sft_reading":
        print(f"  {how:13s} {r['seconds']:7.1f} s  {r['kept'] / r['seconds']:9,.0f} rows/s  "
              f"{r['tokens'] / r['seconds'] / 1e6:.1f} M tokens/s  peak RSS +{r['rss_growth_mib']:,.0f} MiB "
              f"(anonymous +{r['anon_growth_mib']:,.0f} MiB at the end), token file {r['file_mib']:,.0f} MiB  "
              f"load {before} -> {load()}")
    else:
        read_on = f"  shards read per node {r['nodes']}" if r.get("nodes") else ""
        print(f"  {how:13s} {r['seconds']:7.1f} s  {rows / r['seconds']:9,.0f} rows/s  "
              f"{mib / r['seconds']:6.1f} MiB/s  peak RSS +{r['rss_growth_mib']:,.0f} MiB  "
              f"kept {r['kept']:,} {r['dropped']}{read_on}  load {before} -> {load()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[20000, 80000])
    ap.add_argument("--shard-rows", type=int, default=2000)
    ap.add_argument("--response-bytes", type=int, default=4096)
    ap.add_argument("--heldout", type=int, default=500)
    ap.add_argument("--batch-rows", type=int, default=4096)
    ap.add_argument("--unmarked", action="store_true",
                    help="write shards without the shard task's marks: the merge then does all the curation itself")
    ap.add_argument("--ways", nargs="+", default=None,
                    choices=["merge_shards", "write_merged", "write_merged_ray", "sft_loading", "sft_reading",
                             "non_reasoning"],
                    help="run only these (default: every one the code has, but sft_reading and non_reasoning)")
    ap.add_argument("--non-reasoning-format", choices=["parquet", "jsonl"], default="parquet",
                    help="non_reasoning: the user file's format")
    ap.add_argument("--processes", type=int, default=1,
                    help="sft_loading in this many processes at once, as a launch's")
    ap.add_argument("--ray-nodes", type=int, default=2,
                    help="write_merged_ray: the nodes of the local Ray cluster the reads run on (1 CPU each)")
    ap.add_argument("--work", default=None, help="folder for the shards (default: a temporary one)")
    ap.add_argument("--shards", default=None,
                    help="keep the written shards in this folder and reuse them on a later run with the same sizes "
                         "(to time two versions of the merge on the same files)")
    ap.add_argument("--child", nargs=2, metavar=("HOW", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.rows[0], args.heldout, args.batch_rows)
        return

    from grpo.rejection import shards

    print(f"CPU: {cpu()}")
    ways = ["merge_shards"] + (["write_merged"] if hasattr(shards, "write_merged") else [])
    try:
        import grpo.training.sft_rows  # noqa: F401 (SFT reads the merged part files, where the code has it)

        ways += ["sft_loading"] if "write_merged" in ways else []
    except ImportError:
        pass
    # sft_loading reads what write_merged wrote; sft_reading (asked for by name) writes its own token file
    ways = [w for w in ways
            if args.ways is None or w in args.ways or (w == "write_merged" and "sft_loading" in args.ways)]
    ways += ["sft_reading"] if args.ways and "sft_reading" in args.ways else []
    ways += ["non_reasoning"] if args.ways and "non_reasoning" in args.ways else []
    ways += ["write_merged_ray"] if args.ways and "write_merged_ray" in args.ways else []
    if "write_merged_ray" in ways:  # a local cluster of `--ray-nodes` nodes, 1 CPU each, on 127.0.0.1
        os.environ.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
        from ray_local import LocalRayCluster

        cluster = LocalRayCluster(Path(tempfile.mkdtemp(prefix="r1ray-", dir="/tmp")))
        cluster.start(n_nodes=args.ray_nodes).wait_ready()
        os.environ["R1_BENCH_RAY"] = cluster.address
        try:
            return run_sizes(args, ways)
        finally:
            cluster.stop()
    run_sizes(args, ways)


def run_sizes(args: argparse.Namespace, ways: list[str]) -> None:
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        for rows in args.rows:
            out = Path(args.shards or work) / (f"rows-{rows}-{args.shard_rows}-{args.response_bytes}-{args.heldout}"
                                               f"{'-unmarked' if args.unmarked else ''}" if args.shards
                                               else f"rows-{rows}")
            if ways == ["sft_reading"]:
                run_way("sft_reading", out, rows, args, 0.0)
                continue
            if "non_reasoning" in ways:  # its own inputs: a user file of `rows` rows, 2,000 reasoning rows
                out.mkdir(parents=True, exist_ok=True)
                source = out / f"non_reasoning.{args.non_reasoning_format}"
                mib = write_non_reasoning_file(source, rows, args.response_bytes) / 2**20
                write_shards(out / "shards", REASONING_ROWS, args.shard_rows, args.response_bytes, args.heldout)
                print(f"{rows:,} non-reasoning rows, {mib:,.0f} MiB of text in {source.name} "
                      f"({source.stat().st_size / 2**20:,.0f} MiB)")
                run_way("non_reasoning", out, rows, args, mib)
                shutil.rmtree(out)
                if ways == ["non_reasoning"]:
                    continue
            record = out / "written.json"
            if args.shards and record.exists():
                written = json.loads(record.read_text())
                print(f"(the shards written earlier in {out})")
            else:
                written = write_shards(out, rows, args.shard_rows, args.response_bytes, args.heldout, args.unmarked)
                if args.shards:
                    record.write_text(json.dumps(written))
            mib = written["text_bytes"] / 2**20
            marks = ("" if written["mark_s"] is None else
                     f"; shard-side marks (dedupe keys + decontamination) {written['mark_s']:.1f} s of one core, "
                     f"{rows / written['mark_s']:,.0f} rows/s")
            print(f"{rows:,} rows, {mib:,.0f} MiB of text in {len(list(out.glob('shard-*.parquet')))} shards{marks}")
            for how in (w for w in ways if w != "non_reasoning"):
                if how == "write_merged_ray" and (out / "curated").exists():  # write_merged's, read by sft_loading
                    shutil.rmtree(out / "curated")
                run_way(how, out, rows, args, mib)
            for folder in ("curated", "tokens"):
                if (out / folder).exists():
                    for p in (out / folder).iterdir():
                        p.unlink()
                    (out / folder).rmdir()


if __name__ == "__main__":
    main()
