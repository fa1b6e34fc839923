"""Rejection-sampling shard files as the shard tasks write them, small: for the merge's tests here and on a cluster."""

from __future__ import annotations

import pandas as pd

from grpo.configs.data import TaskConfig
from grpo.configs.rejection import RejectionConfig
from grpo.data.arithmetic import generate_problems
from grpo.rejection.curate import curate, mark_rows
from grpo.rejection.store import write_shard

HELDOUT = [p.question for p in generate_problems(TaskConfig(), 40, "heldout")]

CFG = RejectionConfig(max_kept_per_prompt=3, target_samples=150, non_reasoning_rows=5, decontamination_ngram=8,
                      decontamination_threshold=0.8, seed=3, merge_batch_rows=16)


def said(answer: str, reasoning: str) -> str:
    return f"<think>{reasoning}</think><answer>{answer}</answer>"


def tiny_shards(out_dir, index=None, marks: bool = True) -> list[int]:
    """Five shards of 12 prompts, 5 samples each (300 samples): correct, wrong and repeated answers; shard 4 asks
    some of shard 0's prompts again (other ids) with the same answers, case aside; one response quotes a
    held-out problem."""
    problems = generate_problems(TaskConfig(), 60, "train")
    for s in range(5):
        rows = []
        for j in range(12):
            pid = 12 * s + j
            q = problems[(pid - 48) if s == 4 and j < 6 else pid]  # shard 4's first six: shard 0's prompts
            answer = str(q.answer)
            for k in range(5):
                reasoning = ["First add.", "Add them up.", "First add.", "Check twice.", "Count on."][k]
                if s == 4 and j < 6:
                    reasoning = reasoning.upper()  # the same text as shard 0's, case aside
                if pid == 7 and k == 3:
                    reasoning = f"This is the problem: {HELDOUT[5]} So the answer."
                rows.append((q.question, answer, said(answer if (j + k) % 4 else answer + "1", reasoning), pid, k))
        frame = pd.DataFrame(rows, columns=["prompt", "answer", "response", "source_prompt_id", "sample_index"])
        result = curate(frame, CFG)
        if marks:
            result = result._replace(marks=mark_rows(result.kept, index))
        write_shard(result, out_dir, s)
    return list(range(5))


NON_REASONING = pd.DataFrame({"prompt": [f"Say {i}." for i in range(8)], "response": [f"{i}!" for i in range(8)]})
