"""Benchmark: the code reward (each test its own bubblewrap sandbox) against the same tests in a plain subprocess.

    .venv/bin/python benchmarks/code_reward.py [--programs 60] [--workers 2] [--hostile 0.2] [--seed 0]

A deterministic batch of MBPP-style problems (three asserts each): of the programs a share `--hostile` hostile,
the rest 5:3 right and wrong. The hostile ones are hostile in ways that are harmless outside a sandbox (an infinite loop, an early exit, a fake "passed", an
always-equal value, a syntax error, a flood of output; no fork or memory bombs, since the peer runs them bare).

* ours: `check_code(completions, tests, workers=N)`, every test a sandboxed process under the default limits;
* plain: one `python3 -I -S -c "<program>\\n<asserts>"` per program, N at a time, killed at the same wall limit,
  passed when it exits 0: what a checker without a sandbox would do.

Prints one JSON line: programs/s for each, their ratio, and how many programs the plain run scored as passing that
ours did not (the ones that fooled it).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo.rewards.code import check_code, extract_program  # noqa: E402
from grpo.rewards.sandbox import Limits, check_sandbox, interpreter  # noqa: E402

PROBLEMS = [  # (right, wrong, three tests)
    ("def add(a, b):\n    return a + b", "def add(a, b):\n    return a * b",
     ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(5, 7) == 12"]),
    ("def rev(s):\n    return s[::-1]", "def rev(s):\n    return s",
     ["assert rev('abc') == 'cba'", "assert rev('') == ''", "assert rev('ab') == 'ba'"]),
    ("def evens(xs):\n    return [x for x in xs if x % 2 == 0]", "def evens(xs):\n    return xs[::2]",
     ["assert evens([1, 2, 3, 4]) == [2, 4]", "assert evens([]) == []", "assert evens([2, 3]) == [2]"]),
    ("def fact(n):\n    return 1 if n < 2 else n * fact(n - 1)", "def fact(n):\n    return n",
     ["assert fact(5) == 120", "assert fact(0) == 1", "assert fact(3) == 6"]),
]
HOSTILE = [  # each with the right name, so only its hostility decides
    "def {name}(*a):\n    while True:\n        pass",
    "import os\nos._exit(0)",
    "print('all tests passed')\nimport sys\nsys.exit(0)",
    "class Any:\n    def __eq__(self, other):\n        return True\ndef {name}(*a):\n    return Any()",
    "def {name}(*a)\n    return 0",
    "def {name}(*a):\n    print('x' * (4 << 20))",
]


def make_batch(n: int, hostile: float, seed: int) -> tuple[list[str], list[list[str]], list[str]]:
    rng = random.Random(seed)
    completions, tests, kinds = [], [], []
    for i in range(n):
        right, wrong, problem_tests = PROBLEMS[i % len(PROBLEMS)]
        name = right.split("(")[0][4:]
        roll = rng.random()
        if roll < (1 - hostile) * 5 / 8:
            kind, program = "right", right
        elif roll < 1 - hostile:
            kind, program = "wrong", wrong
        else:
            kind, program = "hostile", rng.choice(HOSTILE).format(name=name)
        # a line of its own: every program distinct, so the reward's de-duplication does not flatter it
        completions.append(f"<think>...</think><answer>```python\n# program {i}\n{program}\n```</answer>")
        tests.append(problem_tests)
        kinds.append(kind)
    return completions, tests, kinds


def run_plain(program: str, tests: list[str], python: str, wall_s: float) -> bool:
    """All the asserts after the program in one bare interpreter; passed when it exits 0."""
    try:
        done = subprocess.run([python, "-I", "-S", "-c", program + "\n" + "\n".join(tests)],
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=wall_s)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=60)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--hostile", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    limits = Limits()
    check_sandbox(limits)
    completions, tests, kinds = make_batch(args.programs, args.hostile, args.seed)

    start = time.perf_counter()
    ours = check_code(completions, tests, workers=args.workers, limits=limits, all_or_nothing=True)
    ours_s = time.perf_counter() - start

    python = interpreter(limits.python)
    programs = [extract_program(c) for c in completions]
    start = time.perf_counter()
    with cf.ThreadPoolExecutor(args.workers) as pool:
        plain = list(pool.map(lambda pt: run_plain(pt[0], pt[1], python, limits.wall_time_s), zip(programs, tests)))
    plain_s = time.perf_counter() - start

    fooled = sum(p and not o for p, o in zip(plain, ours.scores))
    print(json.dumps({
        "programs": args.programs, "workers": args.workers,
        "mix": {k: kinds.count(k) for k in ("right", "wrong", "hostile")},
        "ours_programs_per_s": round(args.programs / ours_s, 2),
        "plain_programs_per_s": round(args.programs / plain_s, 2),
        "ours_over_plain_programs_per_s": round(plain_s / ours_s, 3),
        "ours_passed": int(sum(ours.scores)), "plain_passed": sum(plain), "plain_fooled": fooled,
    }))


if __name__ == "__main__":
    main()
