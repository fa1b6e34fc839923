"""Benchmark: how often the answer checkers are right, on the project's labelled audit set (grpo/rewards/audit.py).

    .venv/bin/python benchmarks/reward_audit.py [--seed 0] [--judge-url URL --judge-model NAME]

What `r1 audit-rewards` prints on the shipped set (`grpo.training.verifier_audit.audit_verifiers`, the same call),
with a line per kind of answer form, then one JSON line:

* rule: the accuracy reward as training uses it (`grpo.rewards.accuracy_reward`: its fast paths, then math-verify;
  an ungraded check counts as not accepted);
* math-verify: `verify(parse(reference), parse(completion))`, the library by itself: its own `parse` finds the
  answer in each text (a boxed one, else the last one it can read);
* rule + appeal, with `--judge-url URL --judge-model NAME` (an OpenAI-compatible endpoint: vLLM, a hosted API,
  `r1 serve`): the rule's negatives asked again of that judge (`grpo.training.appeal`), and its calls per 1,000 rows.

Each overall and apart for the forms the rule already read when their pairs were written (`before_tuning`) and
those it was changed to read once these pairs showed it missing them (`after_tuning`). Neither is held out from the
rule: it passed both by how the split was made (`grpo.rewards.audit.SPLIT_NOTE`, printed after the table).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo.configs.grading import JudgeConfig  # noqa: E402
from grpo.rewards.audit import SPLIT_NOTE, audit_pairs  # noqa: E402
from grpo.training.verifier_audit import audit_verifiers, report_figures, report_text  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--judge-url", default=None, help="an OpenAI-compatible endpoint root for the appeal")
    parser.add_argument("--judge-model", default="judge", help="the served model's name (with --judge-url)")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    pairs = audit_pairs(args.seed)
    judge = JudgeConfig(backend="http", base_url=args.judge_url, model=args.judge_model) if args.judge_url else None
    result = audit_verifiers(pairs, judge)
    print(report_text(result, by_kind=True))
    print(SPLIT_NOTE)
    print(json.dumps({"pairs": len(pairs), "seed": args.seed, **report_figures(result)}))


if __name__ == "__main__":
    main()
