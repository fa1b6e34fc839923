"""Benchmark: how often the answer checkers are right, on the project's labelled audit set (grpo/rewards/audit.py).

    .venv/bin/python benchmarks/reward_audit.py [--seed 0]

Prints, for each checker, precision (of the pairs it accepted, the share that are equivalent) and recall (of the
equivalent pairs, the share it accepted), overall and by kind of answer form, then one JSON line:

* rule: the accuracy reward as training uses it (`grpo.rewards.accuracy_reward`: its fast paths, then math-verify;
  an ungraded check counts as not accepted);
* math-verify: `verify(parse(reference), parse(completion))`, the library by itself: its own `parse` finds the
  answer in each text (a boxed one, else the last one it can read);
* rule + appeal, with `--judge-url URL --judge-model NAME` (an OpenAI-compatible endpoint: vLLM, a hosted API,
  `r1 serve`): the rule's negatives asked again of that judge (`grpo.training.appeal`), and its calls per 1,000 rows.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo.rewards import accuracy_reward  # noqa: E402
from grpo.rewards.audit import audit, audit_pairs  # noqa: E402


def rule(references: list[str], completions: list[str]) -> list[bool | None]:
    return [s == 1.0 for s in accuracy_reward(completions, references, timeout_s=5.0)]


def math_verify_alone(references: list[str], completions: list[str]) -> list[bool | None]:
    """math-verify by itself: its own `parse` finds the answer in the reference and in the whole completion."""
    import math_verify

    out = []
    for reference, completion in zip(references, completions):
        try:
            out.append(bool(math_verify.verify(math_verify.parse(reference), math_verify.parse(completion))))
        except Exception:
            out.append(None)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--judge-url", default=None, help="an OpenAI-compatible endpoint root for the appeal")
    parser.add_argument("--judge-model", default="judge", help="the served model's name (with --judge-url)")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    pairs = audit_pairs(args.seed)
    figures = {}
    checkers = [("rule", rule), ("math-verify", math_verify_alone)]
    if args.judge_url:
        from grpo.configs.core import JudgeConfig
        from grpo.sampling.judge import HTTPJudge
        from grpo.training.appeal import appealed

        judge = HTTPJudge(JudgeConfig(backend="http", base_url=args.judge_url, model=args.judge_model))
        judge.check_available()
        with_appeal = appealed(accuracy_reward, judge)

        def rule_and_appeal(references: list[str], completions: list[str]) -> list[bool | None]:
            said = [s == 1.0 for s in with_appeal(completions, answer=references, timeout_s=5.0)]
            figures["appeal_calls_per_1000_rows"] = round(1000 * with_appeal.take_figures()["appeal_calls"]
                                                          / len(completions), 1)
            return said

        checkers.append(("rule + appeal", rule_and_appeal))
    for name, check in checkers:
        result = audit(check, pairs)
        figures[name] = {"precision": round(result.precision, 4), "recall": round(result.recall, 4),
                         "undecided": result.undecided}
        print(f"{name}: precision {result.precision:.3f}, recall {result.recall:.3f} ({result.accepted} accepted, "
              f"{result.positives} equivalent of {len(pairs)} pairs, {result.undecided} undecided)")
        for kind, (p, r) in result.by_kind.items():
            print(f"  {kind:<24} precision {p:.3f}  recall {r:.3f}")
    print(json.dumps({"pairs": len(pairs), "seed": args.seed, **figures}))


if __name__ == "__main__":
    main()
