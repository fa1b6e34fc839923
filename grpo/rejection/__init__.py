"""Stage 3, rejection sampling: many samples per prompt from the RL checkpoint; keep the correct, readable ones.

The R1 paper (section 2.3.3): sample several responses per prompt from the reasoning-RL checkpoint; keep only the
correct ones, checked by rule where the prompt has a verifiable answer and otherwise by a generative judge
(DeepSeek-V3 given the reference and the prediction); drop chains of thought with mixed languages, long paragraphs
or code blocks. About 600k reasoning samples plus 200k non-reasoning ones make the 800k rows of the next SFT stage.

Here one sample goes through `curate` in this order, and is counted under the first check it fails, so
generated = kept + sum(dropped):
  readability filters (`READABILITY_CHECKS`, in `cfg.filters` order) -> duplicate of an earlier sample of the
  same prompt -> correctness (rule, judge, or both) -> at most `max_kept_per_prompt` per prompt.
The rule check is the row's own (grpo.rewards.correct): a row with tests (code) is right when its program passes all
of them in the sandbox, any other row when its answer matches the reference.
Truncation is counted but is no reason of its own: a response cut off by the token budget never closes its answer
block (the tag filter drops it), and one cut just after `</answer>` is whole.
The prompts are cut into shards of `shard_size`. Each shard samples under a seed of its own (cfg.seed, index), so a
shard sampled again gives the same samples, and is written as one Parquet file, atomically; a shard whose file
exists is not sampled again, so a crashed or cancelled run resumes without losing or duplicating rows.
Each shard also marks its kept rows where they were sampled: a 64-bit hash of the normalised (prompt, response) and,
against the held-out prompts, whether the row copies one (`mark_rows`; hashed word n-grams, each distinct prompt
checked once). `merge_shards` then reads those keys alone to dedupe across shards, drop the contaminated rows and
cap the reasoning rows to the target (prompt coverage first, deterministically), reads only the rows it keeps, and
appends the non-reasoning rows; `write_merged` streams the same rows to Parquet files a batch at a time, the
non-reasoning ones read a batch at a time from the part files `grpo.rejection.non_reasoning` wrote them to.

How it differs from the paper: the paper does not spell out its readability rules; the ones here (tag structure,
language share, paragraph and reasoning length, code in the reasoning, empty answer, repetition) are plain
functions with their thresholds in `RejectionConfig`. Sampling stops at the planned prompts, not at the target.

Run it alone:
    engine = build_engine(GenerationConfig(), model, tok)  # grpo.sampling.engines
    result = run_rejection_sampling(engine, prompts_df, RejectionConfig(), "out/rs")
    result.dataset  # prompt, response, ... ready for SFT

| module | what it holds |
|---|---|
| `filters` | readability filters, drop reasons and counts |
| `curate` | one shard's samples kept or dropped; dedupe and decontamination, and the marks the merge reads |
| `shards` | planning, sampling and resuming shards |
| `store` | shard files, written atomically, in a folder or an fsspec store |
| `merge` | the dataset from the shards: their keys read, the kept rows read and written a batch at a time |
| `ray_reader` | the merge's two reads on a Ray cluster's nodes, through Ray Data |
| `non_reasoning` | the non-reasoning rows: generated or a user's file, written to part files and read back a batch at a time |
| `budget` | sizing a run before it starts: samples, tokens, rows kept, time (`r1 plan`) |

The stage's settings are `grpo.configs.rejection.RejectionConfig`. Must not depend on Prefect or MLflow.
"""
