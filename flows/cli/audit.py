"""`r1 audit-rewards`: how often the answer checkers are right, on the project's labelled set or a user's own rows.

    r1 audit-rewards [--file ROWS.jsonl] [--judge URL [--judge-model NAME]] [--recipe R] [--by-kind] [--json]

Prints precision, recall and the TP/FP/FN/TN counts (and the rows each checker could not grade, with why) of the
accuracy rule, of math-verify alone and, with a judge, of the rule with its negatives appealed to that judge
(`grpo.training.verifier_audit`), overall and by `added`: on the shipped set, the forms the rule already read when
their pairs were written and those it was changed to read (`grpo.rewards.audit`), with a line saying that the rule
passed both by how the split was made: neither is held out. The judge is an OpenAI-compatible endpoint: `--judge`,
else the recipe's appeal judge (reasoning_grpo.grpo.grading.appeal), else its rejection-sampling judge, when it is http.

A bad row in `--file` (not JSON, a missing field, an `equal` that is not true or false) is told in one line naming
the file, the row and the field, before anything is graded; so is a judge that does not answer. Loads no torch, no
Prefect and no MLflow.
"""

from __future__ import annotations

import argparse
import json
import logging

from flows.checks import UsageError


def add_parser(sub, parents) -> None:
    audit = sub.add_parser("audit-rewards", parents=parents,
                           help="precision and recall of the answer checkers (the rule, math-verify, rule + "
                                "appeal) on the labelled audit set or your own rows")
    audit.add_argument("--file", default=None, metavar="ROWS.jsonl",
                       help="your labelled rows, one JSON object a line: {\"reference\": ..., \"answer\": ..., "
                            "\"equal\": true|false}, optionally \"kind\" and \"added\" to group by (default: the "
                            "shipped set)")
    audit.add_argument("--seed", type=int, default=0, help="the shipped set's seed (default: 0, the published one)")
    audit.add_argument("--judge", default=None, metavar="URL",
                       help="an OpenAI-compatible endpoint root (http://host:8000/v1) to appeal the rule's "
                            "negatives to (default: the recipe's judge; none: rule + appeal is skipped)")
    audit.add_argument("--judge-model", default="judge", help="the model the judge endpoint serves (default: judge)")
    audit.add_argument("--judge-api-key-env", default="R1_JUDGE_API_KEY",
                       help="NAME of the env var holding the judge's key (default: R1_JUDGE_API_KEY)")
    audit.add_argument("--recipe", default=None,
                       help="take the judge from this recipe (reasoning_grpo.grpo.grading.appeal, else "
                            "rejection_sampling.judge) when --judge is not given")
    audit.add_argument("--by-kind", action="store_true", help="also a line per answer form")
    audit.add_argument("--json", action="store_true", help="also the figures as one JSON line")


def judge_config(args: argparse.Namespace):
    """The judge to appeal to: --judge, else the recipe's (appeal, then rejection sampling's), else None."""
    from grpo.configs.grading import JudgeConfig

    if args.judge:
        if not args.judge.startswith(("http://", "https://")):
            raise UsageError(f"--judge {args.judge!r}: expected an endpoint root such as http://127.0.0.1:8000/v1")
        return JudgeConfig(backend="http", base_url=args.judge.rstrip("/"), model=args.judge_model,
                           api_key_env=args.judge_api_key_env)
    if not args.recipe:
        return None
    from grpo.configs.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    for where, cfg in (("reasoning_grpo.grpo.grading.appeal", recipe.reasoning_grpo.grpo.grading.appeal),
                       ("rejection_sampling.judge", recipe.rejection_sampling.judge)):
        if cfg is None:
            continue
        if cfg.backend != "http":
            raise UsageError(f"recipe {recipe.name}: {where} is a local model (backend {cfg.backend}); serve it "
                             f"(`r1 serve {cfg.model}`) and give --judge URL")
        return cfg
    return None


def run(args: argparse.Namespace) -> int:
    from grpo.rewards.audit import SPLIT_NOTE, AuditFileError, audit_pairs, read_rows

    if args.file:
        try:
            pairs = read_rows(args.file)
        except AuditFileError as e:
            raise UsageError(str(e)) from None
        where = f"{args.file} ({len(pairs)} rows)"
    else:
        pairs = audit_pairs(args.seed)
        where = f"the shipped audit set, seed {args.seed} ({len(pairs)} pairs)"
    judge = judge_config(args)
    checkers = (f"the rule, math-verify alone and rule + appeal to {judge.model!r} at {judge.base_url}" if judge
                else "the rule and math-verify alone")
    print(f"auditing {checkers} on {where}", flush=True)
    from grpo.sampling.judge import JudgeUnavailable
    from grpo.training.verifier_audit import audit_verifiers, report_figures, report_text

    logging.getLogger("grpo.rewards.accuracy").setLevel(logging.ERROR)  # its timeouts are counted in the table
    try:
        result = audit_verifiers(pairs, judge)
    except JudgeUnavailable as e:
        raise UsageError(f"judge: {e}") from None
    print(report_text(result, by_kind=args.by_kind))
    if not args.file:
        print(SPLIT_NOTE)
    if args.json:
        print(json.dumps(report_figures(result)))
    return 0
