"""Benchmark: grpo.rewards.accuracy_reward vs plain math-verify on the same pairs.

    .venv/bin/python benchmarks/accuracy_reward.py [--pairs 2000] [--seed 0]

Builds a deterministic mix of completion/reference pairs (~70% plain integers
and decimals, with and without thousands separators, ~30% LaTeX: fractions,
radicals, multiples of pi, polynomials; about 40% of the answers wrong),
then times

* ours: ``accuracy_reward(completions, answer)`` (one call, pool already warm);
* math-verify: ``verify(parse(gold), parse(pred))`` pair by pair on the main
  thread with its default settings, on the extracted answers. Both sides see
  the same strings: ``prepare_for_math_verify`` wraps bare LaTeX in ``$…$``,
  without which math-verify cannot read ``\\frac13`` or ``\\sqrt{2}`` at all.

and checks the verdicts agree. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo.rewards.math_verify_pool import _POOL  # noqa: E402
from grpo.rewards import (  # noqa: E402
    accuracy_reward,
    check_accuracy,
    extract_answer,
    prepare_for_math_verify,
)


def _plain_pair(rng: random.Random) -> tuple[str, str]:
    kind = rng.random()
    if kind < 0.5:
        value = rng.randint(0, 10_000_000)
        gold = f"{value:,}" if rng.random() < 0.3 else str(value)
    elif kind < 0.8:
        value = rng.randint(-99_999, 99_999) / 100
        gold = f"{value:.2f}"
    else:
        value = rng.randint(-5000, 5000)
        gold = str(value)
    v = float(gold.replace(",", ""))
    is_int = "." not in gold
    r = rng.random()
    if r < 0.45:  # correct, same spelling
        pred = gold
    elif r < 0.6:  # correct, another spelling
        if is_int:
            pred = rng.choice([f"{int(v):,}", str(int(v)), f"${int(v)}$", f"{int(v)}.", f"{int(v)}.0"])
        else:
            pred = rng.choice([f"{v:.3f}", f"{v:,.2f}", f"${v:.2f}$", f"{v:.2f}."])
    else:  # wrong
        delta = rng.choice([1, -1, 10, 0.5, 0.01]) if not is_int else rng.choice([1, -1, 10, 100])
        w = v + delta
        pred = str(int(w)) if is_int else f"{w:.2f}"
    return gold, pred


def _latex_pair(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(4)
    right = rng.random() < 0.55
    if kind == 0:  # fractions
        a, b = rng.randint(1, 40), rng.randint(2, 41)
        gold = rf"\frac{{{a}}}{{{b}}}"
        if right:
            pred = rng.choice([gold, f"{a}/{b}", rf"\dfrac{{{2 * a}}}{{{2 * b}}}", f"{a / b:.6f}"])
        else:
            pred = rng.choice([rf"\frac{{{a + 1}}}{{{b}}}", f"{b}/{a}", f"{a / b + 0.01:.4f}"])
    elif kind == 1:  # radicals
        k, m = rng.randint(2, 9), rng.choice([2, 3, 5, 6, 7, 10, 11, 13])
        gold = rf"{k}\sqrt{{{m}}}"
        if right:
            pred = rng.choice([gold, rf"\sqrt{{{k * k * m}}}", rf"{k} \sqrt{m}"])
        else:
            pred = rng.choice([rf"{k + 1}\sqrt{{{m}}}", rf"\sqrt{{{k * m}}}", rf"{k}\sqrt{{{m + 1}}}"])
    elif kind == 2:  # multiples of pi
        a, b = rng.randint(1, 11), rng.choice([2, 3, 4, 6, 12])
        gold = rf"\frac{{{a}\pi}}{{{b}}}"
        if right:
            pred = rng.choice([gold, rf"\frac{{{a}}}{{{b}}}\pi", rf"{a}\pi/{b}"])
        else:
            pred = rng.choice([rf"\frac{{{a + 1}\pi}}{{{b}}}", rf"\frac{{{a}}}{{{b}}}", rf"{a}\pi"])
    else:  # polynomials
        p, q = rng.randint(1, 9), rng.randint(2, 5)
        gold = f"x^{q}+{p}x"
        if right:
            pred = rng.choice([gold, f"x(x^{q - 1}+{p})", f"{p}x+x^{q}"])
        else:
            pred = rng.choice([f"x^{q}+{p + 1}x", f"x^{q + 1}+{p}x", f"x(x^{q}+{p})"])
    return gold, pred


def _completion(rng: random.Random, pred: str) -> str:
    think = "<think>\nLet me work through this step by step.\n</think>\n"
    if rng.random() < 0.5:
        return f"{think}<answer>{pred}</answer>"
    return f"{think}So the final answer is $\\boxed{{{pred}}}$."


def build_pairs(n: int, seed: int) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    completions, golds = [], []
    for _ in range(n):
        gold, pred = _plain_pair(rng) if rng.random() < 0.7 else _latex_pair(rng)
        completions.append(_completion(rng, pred))
        golds.append(gold)
    return completions, golds


def math_verify_verdicts(completions: list[str], golds: list[str]) -> list[bool]:
    from math_verify import parse, verify

    verdicts = []
    for completion, gold in zip(completions, golds):
        pred = extract_answer(completion)
        ok = pred is not None and verify(parse(prepare_for_math_verify(gold)), parse(prepare_for_math_verify(pred)))
        verdicts.append(bool(ok))
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=["thread", "process"], default="process",
                        help="where symbolic checks run (the reward's default is thread)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)

    completions, golds = build_pairs(args.pairs, args.seed)
    warm_c, warm_g = build_pairs(40, args.seed + 1)

    # Warm-ups, untimed: our worker pool (spawn + imports), math-verify's imports/parser.
    t0 = time.perf_counter()
    accuracy_reward(warm_c, warm_g, symbolic_backend=args.backend)
    cold_start_s = time.perf_counter() - t0
    math_verify_verdicts(warm_c, warm_g)

    t0 = time.perf_counter()
    report = check_accuracy(completions, golds, symbolic_backend=args.backend)
    ours_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    reference = math_verify_verdicts(completions, golds)
    mv_s = time.perf_counter() - t0

    ours = [score == 1.0 for score in report.scores]
    disagreements = [
        (golds[i], extract_answer(completions[i]), report.scores[i], reference[i])
        for i in range(len(golds))
        if ours[i] != reference[i] or report.scores[i] is None
    ]
    for gold, pred, score, ref in disagreements[:10]:
        print(f"DISAGREE gold={gold!r} pred={pred!r} ours={score} math_verify={ref}", file=sys.stderr)
    print(
        json.dumps(
            {
                "pairs": len(golds),
                "ours_s": round(ours_s, 3),
                "math_verify_s": round(mv_s, 3),
                "speedup": round(mv_s / ours_s, 1),
                "disagreements": len(disagreements),
                "fast_path": report.fast_path,
                "symbolic": report.symbolic,
                "timeouts": report.timeouts,
                "correct": sum(ours),
                "backend": args.backend,
                "workers": _POOL.workers() if args.backend == "process" else 1,
                "pool_cold_start_s": round(cold_start_s, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
