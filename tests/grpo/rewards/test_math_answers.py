"""The math-answer engine behind the accuracy reward: the exact fast paths against math-verify, and the symbolic
check's pool and timeouts (CPU; some tests start the process pool)."""

from __future__ import annotations

import math
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from grpo.rewards.outcomes import TIMEOUT, Ungraded, reason_of
from grpo.rewards import (
    accuracy_reward,
    check_accuracy,
    math_fast,
    math_latex,
    math_verify_pool,
    prepare_for_math_verify,
)


def _math_verify_verdict(gold: str, pred: str) -> bool:
    """Plain math-verify on the same strings (main thread, default settings)."""
    from math_verify import parse, verify

    return verify(parse(prepare_for_math_verify(gold)), parse(prepare_for_math_verify(pred)))


def test_fast_and_symbolic_paths_agree_with_math_verify():
    pairs = [  # (pred, gold)
        ("42", "42"), ("1,000", "1000"), ("3.50", "3.5"), ("-7", "7"), ("0.333333", "1/3"),
        ("1.5", "\\frac{3}{2}"), ("2.0001", "2"), ("12", "12.000001"),
        ("\\sqrt{8}", "2\\sqrt{2}"), ("\\frac{\\pi}{2}", "90"), ("2x+2", "2(x+1)"),
        ("\\{1,2\\}", "\\{2,1\\}"), ("x=5", "5"), ("50\\%", "0.5"), ("1.4142136", "\\sqrt{2}"),
        ("3\\sqrt{2}", "\\sqrt{17}"), ("\\frac{5\\pi}{6}", "\\frac{5}{6}\\pi"), ("y^2", "x^2"),
    ]  # fmt: skip
    report = check_accuracy([f"<answer>{p}</answer>" for p, _ in pairs], [g for _, g in pairs])
    assert report.fast_path > 0 and report.symbolic > 0 and report.timeouts == 0
    expected = [float(_math_verify_verdict(g, p)) for p, g in pairs]
    assert report.scores == expected
    assert 0.0 in expected and 1.0 in expected


def test_latex_shortcut_matches_math_verify_values():
    # The subset evaluator only ever proves "different"; its reading of each
    # string must match math-verify's own parse.
    import sympy
    from math_verify import parse

    samples = [
        "2\\sqrt{3}", "\\frac{5\\pi}{6}", "x^2+3x", "x(x+3)", "\\sqrt[3]{27}", "\\frac12+\\dfrac{1}{3}",
        "-x^2+2", "2^{x}", "\\left(x+1\\right)^2", "3\\cdot 4", "6/4", "\\sqrt2 y", "a^2 b", "\\pi r^2",
        "\\frac{\\sqrt{2}}{2}", "2.5x", "x^{1/2}", "\\tfrac{1}{4}\\pi",
        "\\sqrt23", "4 \\sqrt10", "\\sqrt23^2", "x\\sqrt23\\pi", "\\sqrt{12}y^3",
    ]  # fmt: skip
    for s in samples:
        ours = math_latex.latex_value(s)
        assert ours is not None, s
        expr = next(e for e in parse(prepare_for_math_verify(s)) if isinstance(e, sympy.Basic))
        value = float(expr.evalf(30, subs={sym: math_latex._probe(sym.name) for sym in expr.free_symbols}))
        assert math.isclose(ours, value, rel_tol=1e-9), (s, ours, value)
    # Outside the subset: left to math-verify.
    for s in ["2\\frac{1}{2}", "1/2x", "5m", "xy", "{1,2}", "x", "e^2", "\\sqrt{-1}", "1,5", "\\sqrt{2}3"]:
        assert math_latex.latex_value(s) is None, s


# Equal in value, and proved equal without math-verify (the exact canonical form).
EXACT_EQUAL = [  # (gold, pred)
    ("x^3+4x", "x(x^2+4)"), ("x^2+4x", "4x+x^2"), ("2\\sqrt{3}", "\\sqrt{12}"), ("3\\sqrt{6}", "3 \\sqrt6"),
    ("\\frac{5\\pi}{12}", "\\frac{5}{12}\\pi"), ("\\frac{10\\pi}{6}", "10\\pi/6"), ("2x", "x+x"),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"), ("(1+\\sqrt{2})^2", "3+2\\sqrt{2}"), ("x^2-y^2", "(x-y)(x+y)"),
    ("\\frac{\\pi}{\\sqrt{3}}", "\\frac{\\sqrt{3}\\pi}{3}"), ("\\sqrt{\\frac{1}{2}}", "\\frac{\\sqrt2}{2}"),
    ("3", "\\sqrt{9}"), ("3\\sqrt{2}", "\\sqrt23"), ("\\frac{x}{2}", "\\frac12 x"), ("\\pi^2", "\\pi\\cdot\\pi"),
]  # fmt: skip
# Equal in value (or nearly) but outside the exact shortcut: math-verify decides, and it does not always say equal.
EXACT_DECLINED = [  # (gold, pred)
    ("x", "1x"),  # a lone symbol: math-verify compares symbols by name (False)
    ("(x)", "x"),  # same value, lone symbol again (True)
    ("x", "\\frac{x^2}{x}"),  # division by a variable (False)
    ("\\frac{1}{x}", "x^{-1}"),  # negative power
    ("2", "\\sqrt[3]{8}"),  # roots other than square roots
    ("\\frac{x}{2}", "0.5x"),  # a decimal is a Float to math-verify
    ("\\sqrt{3}-1", "\\frac{2}{1+\\sqrt{3}}"),  # division by a sum
    ("x^9+1", "(x^3+1)(x^6-x^3+1)"),  # power above the cap
]  # fmt: skip


def test_exact_shortcut_claims_equality_only_where_math_verify_does():
    for gold, pred in EXACT_EQUAL:
        assert math_fast.fast_verdict(gold, pred) is True, (gold, pred)
        assert _math_verify_verdict(gold, pred), (gold, pred)
    for gold, pred in EXACT_DECLINED:
        assert math_fast.fast_verdict(gold, pred) is None, (gold, pred)
    report = check_accuracy([f"<answer>{p}</answer>" for _, p in EXACT_DECLINED], [g for g, _ in EXACT_DECLINED])
    assert report.symbolic == len(EXACT_DECLINED)
    expected = [float(_math_verify_verdict(g, p)) for g, p in EXACT_DECLINED]
    assert report.scores == expected
    assert 0.0 in expected and 1.0 in expected


def _random_product_pair(rng: random.Random) -> tuple[str, str]:
    """(s1)(s2) against its expansion term by term, sometimes with one term changed (then unequal)."""
    atoms = ["x", "2x", "y", "x^2", "7", "\\sqrt{2}", "3\\sqrt{5}", "\\sqrt{8}", "\\pi", "\\frac{1}{2}",
             "\\frac{\\pi}{3}", "\\frac{x}{4}", "\\sqrt{6}"]  # fmt: skip
    first = [(rng.choice("+-"), rng.choice(atoms)) for _ in range(rng.randint(1, 3))]
    second = [(rng.choice("+-"), rng.choice(atoms)) for _ in range(rng.randint(1, 3))]

    def render(terms: list[tuple[str, str]]) -> str:
        return "".join(f"{sign}{t}" if i or sign == "-" else t for i, (sign, t) in enumerate(terms))

    products = [("+" if s1 == s2 else "-", f"{t1} \\cdot {t2}") for s1, t1 in first for s2, t2 in second]
    if rng.random() < 0.4:
        i = rng.randrange(len(products))
        products[i] = (products[i][0], products[i][1] + " \\cdot 2")
    rng.shuffle(products)
    return f"({render(first)})({render(second)})", render(products)


def test_exact_shortcut_against_math_verify_on_random_expressions():
    rng = random.Random(0)
    pairs = [_random_product_pair(rng) for _ in range(40)]
    verdicts = [math_fast.fast_verdict(gold, pred) for gold, pred in pairs]
    for (gold, pred), verdict in zip(pairs, verdicts):
        if verdict is not None:
            assert verdict == _math_verify_verdict(gold, pred), (gold, pred, verdict)
    assert verdicts.count(True) >= 15 and verdicts.count(False) >= 5  # the shortcut does decide most of them


def test_decimal_rounding_rule_matches_math_verify():
    # A fraction or a decimal against a decimal within rounding reach: decided
    # by math-verify's own rule (6 decimals on its sympy numbers), ties included.
    rng = random.Random(1)
    pairs = [
        ("0.3333333", "0.333333"), ("0.5", "0.5000004"), ("0.5", "0.4999995"), ("0.5", "0.5000005"),
        ("1,234", "1234.0000004"), ("2.0000005", "2.000001"), ("-0.0000005", "0"), ("1/8", "0.1250005"),
        ("\\frac{1}{3}", "0.333334"), ("\\frac{2}{3}", "0.666667"), ("\\frac{2}{3}", "0.666666"),
    ]  # fmt: skip
    for _ in range(30):
        a, b = rng.randint(1, 99), rng.randint(2, 99)
        shift = rng.choice([0, 0, 1e-6, -1e-6, 5e-7, -5e-7])
        pairs.append((f"\\frac{{{a}}}{{{b}}}", f"{a / b + shift:.{rng.choice([6, 7])}f}"))
    for gold, pred in pairs:
        verdict = math_fast.fast_verdict(gold, pred)
        assert verdict is not None, (gold, pred)
        assert verdict == _math_verify_verdict(gold, pred), (gold, pred, verdict)
    # Beyond 15 significant digits a decimal is not exact in math-verify's Float: it decides.
    assert math_fast.fast_verdict("0.1234567890123456", "0.123457") is None


def test_split_square_against_a_naive_loop():
    def naive(m: int) -> tuple[int, int]:
        k = max(d for d in range(1, math.isqrt(m) + 1) if m % (d * d) == 0)
        return k, m // (k * k)

    for m in [*range(1, 3000), 2**20, 3 * 7**6, 999_983**1, 31_607 * 31_627, 997**3, 10**9]:
        assert math_latex._split_square(m) == naive(m), m

def test_square_root_of_several_digits_reads_as_latex_does():
    # \sqrt10 is \sqrt{1}0 = 0 in LaTeX and in math-verify, not the square root of 10.
    for gold, pred, equal in [("4\\sqrt{10}", "4 \\sqrt10", False), ("\\sqrt{2}\\cdot 3", "\\sqrt23", True),
                              ("0", "4\\sqrt10", True), ("9\\sqrt{3}", "3\\sqrt{27}", True)]:  # fmt: skip
        assert math_fast.fast_verdict(gold, pred) is equal, (gold, pred)
        assert _math_verify_verdict(gold, pred) is equal, (gold, pred)


def test_accuracy_from_worker_threads():
    completions = ["<answer>\\sqrt[3]{8}</answer>", "<answer>7,425,000</answer>", "<answer>\\sqrt{3}</answer>"]
    answers = ["2", "7425000", "\\sqrt{2}"]  # the first needs math-verify
    results = []
    thread = threading.Thread(target=lambda: results.append(accuracy_reward(completions, answers,
                                                                              symbolic_backend="process")))
    thread.start()
    thread.join(60)
    assert results == [[1.0, 1.0, 0.0]]
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda _: accuracy_reward(completions, answers), range(2)))
    assert outs == [[1.0, 1.0, 0.0]] * 2
    # The process backend gives the same verdicts.
    assert accuracy_reward(completions, answers, symbolic_backend="process") == [1.0, 1.0, 0.0]


def _slow_expression(terms: int = 400) -> str:
    return "+".join(f"\\frac{{{i}}}{{{i + 1}}}x^{{{i}}}" for i in range(1, terms))


def test_pathological_input_times_out_in_worker_process():
    accuracy_reward(["<answer>\\sqrt{2}</answer>"], ["\\sqrt{2}"], symbolic_backend="process")  # pool started first
    slow = _slow_expression()
    start = time.perf_counter()
    report = check_accuracy([f"<answer>{slow}</answer>", "<answer>3</answer>"], [slow + "+1", "3"], timeout_s=0.2,
                            symbolic_backend="process")
    elapsed = time.perf_counter() - start
    assert report.scores == [Ungraded(TIMEOUT, "math-verify ran past 0.2 s, then 1 s"), 1.0]  # not wrong: ungraded
    assert report.timeouts == 1
    assert elapsed < 5.0  # without the limit this parse takes far longer


def test_hung_check_in_thread_fallback_is_abandoned(monkeypatch):
    def hang(*args, **kwargs):
        time.sleep(5)
        return [math_verify_pool.EQUAL]

    monkeypatch.setattr(math_verify_pool, "_check_group", hang)
    start = time.perf_counter()
    report = check_accuracy(["<answer>\\sqrt[3]{8}</answer>"], ["2"], timeout_s=0.1, symbolic_backend="thread")
    assert time.perf_counter() - start < 2.0
    assert [reason_of(s) for s in report.scores] == [TIMEOUT] and report.timeouts == 1


def test_stuck_pool_is_killed_and_counted_as_timeouts(monkeypatch):
    pool = math_verify_pool._SymbolicPool()
    monkeypatch.setattr(pool, "_STARTUP_GRACE_S", 0.0)
    monkeypatch.setattr(pool, "_BACKSTOP_SLACK_S", -1.95)  # budget 1.0*2 - 1.95 = 0.05 s: workers cannot even start
    start = time.perf_counter()
    results = pool.run([[("\\sqrt{2}", ["\\sqrt{2}"])]], timeout_s=1.0)
    assert time.perf_counter() - start < 5.0
    assert results == [math_verify_pool.TIMEOUT]
    assert pool._executor is None  # killed and forgotten; the next call builds a new one
    monkeypatch.setattr(pool, "_BACKSTOP_SLACK_S", 10.0)
    monkeypatch.setattr(pool, "_STARTUP_GRACE_S", 60.0)
    assert pool.run([[("\\sqrt{2}", ["\\sqrt{2}", "\\sqrt{3}"])]], timeout_s=2.0) == [[[1, 0]]]
    pool.shutdown()




def test_the_rule_on_the_audit_set_and_an_amount_in_dollars():
    """The project's labelled audit set (equivalent and non-equivalent answer pairs in the forms graders miss): the
    accuracy reward keeps every non-equivalent pair out and finds the equivalent ones, dollar amounts included."""
    from grpo.rewards.audit import audit_pairs
    from grpo.training.verifier_audit import audit, rule

    pairs = audit_pairs(seed=0)
    assert len(pairs) >= 400 and {p.kind for p in pairs} >= {"currency", "intervals", "sets", "gsm8k_tails", "boxed"}
    result = audit(rule, pairs)
    assert result.overall.precision >= 0.99 and result.overall.recall >= 0.97, result
    # the forms the rule read before the set was written: not held out (that is why they are in this group), a check
    # that later changes to the rule kept them
    before_tuning = result.by_added["before_tuning"]
    assert before_tuning.precision >= 0.99 and before_tuning.recall >= 0.97, before_tuning
    assert accuracy_reward(["<answer>\\$1,272.50</answer>", "<answer>$12$</answer>"], ["1272.5", "\\$12"]) == [1.0, 1.0]


class _KillsItsWorker:
    """Unpickled in a worker process, it ends that process: a worker that dies mid-check, as one killed for memory
    or in C code does."""

    def __reduce__(self):
        import os

        return os._exit, (1,)


def test_a_check_that_raises_and_a_pool_that_crashes_are_named_for_what_happened(monkeypatch):
    """A check that raises is ungraded for `raised`, one whose worker process died (in the pool and again in the
    fresh one it is retried in) for `pool_crash`; neither is reported as a timeout."""
    from grpo.rewards.accuracy import symbolic_outcome
    from grpo.rewards.outcomes import POOL_CRASH, RAISED

    # a prediction that is not a string: the check itself raises (in a thread, beside a pair that checks fine)
    assert math_verify_pool.symbolic_verdicts([("\\sqrt{2}", 5), ("\\sqrt{2}", "\\sqrt{2}")], 2.0, "thread") == [
        math_verify_pool.RAISED, math_verify_pool.EQUAL]
    monkeypatch.setenv("R1_REWARD_WORKERS", "1")
    pool = math_verify_pool._SymbolicPool()
    try:
        assert pool.run([[("\\sqrt{2}", [_KillsItsWorker()])], [("2", ["2"])]], timeout_s=5.0) == [
            math_verify_pool.CRASHED, math_verify_pool.CRASHED]  # the broken pool takes every chunk it held
        assert pool.run([[("\\sqrt{2}", ["\\sqrt{2}", 5])]], timeout_s=5.0) == [[[math_verify_pool.EQUAL,
                                                                                   math_verify_pool.RAISED]]]
    finally:
        pool.shutdown()
    assert [reason_of(symbolic_outcome(code, 2.0)) for code in (math_verify_pool.TIMEOUT, math_verify_pool.RAISED,
                                                                math_verify_pool.CRASHED)] == [TIMEOUT, RAISED,
                                                                                               POOL_CRASH]
