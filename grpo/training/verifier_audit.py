"""The verifier audit: how often each answer checker is right on labelled pairs (the shipped set of
`grpo.rewards.audit`, or a user's own rows), as precision, recall and the counts behind them.

Three checkers, each answering every pair with True (accepted), False, or `Ungraded` (it could not say, and why):

* `rule`: the accuracy reward as training uses it (`grpo.rewards.accuracy_reward`: its fast paths, then math-verify);
  a bare answer (no answer tags, no box) is read whole, as if in the answer tags;
* `math_verify_alone`: `verify(parse(reference), parse(answer))`, the library by itself: its own `parse` finds the
  answer in each text;
* `rule_and_appeal(judge)`: the rule, with each of its 0.0s asked again of a judge with the reference
  (`grpo.training.appeal`, TinyV's appeal): a yes turns it into an acceptance.

A row a checker could not grade counts as not accepted (a false negative when it is equal, a true negative when not)
and is listed with its reason: a checker that cannot read a right answer has not passed it.

`audit_verifiers` runs them all and `report_text` says what they did; `r1 audit-rewards` and
`benchmarks/reward_audit.py` are both these two calls.

Must not depend on Prefect or MLflow; the judge's module is imported only when a judge is given.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import NamedTuple

from grpo.configs.grading import JudgeConfig
from grpo.rewards import accuracy_reward
from grpo.rewards.answers import extract_answer
from grpo.rewards.audit import Pair
from grpo.rewards.outcomes import RAISED, Ungraded
from grpo.training.appeal import appealed

UNREADABLE_REFERENCE = "unreadable_reference"  # the rule's None: an empty reference, or one math-verify cannot parse
RULE, MATH_VERIFY, RULE_AND_APPEAL = "rule", "math-verify", "rule + appeal"

Verdicts = list[bool | Ungraded]


class Scores(NamedTuple):
    tp: int  # equal, accepted
    fp: int  # not equal, accepted
    fn: int  # equal, not accepted (ungraded ones included)
    tn: int  # not equal, not accepted (ungraded ones included)
    ungraded: dict[str, int]  # reason -> rows the checker could not grade, counted in fn or tn

    @property
    def precision(self) -> float:
        """Of the rows accepted, the share that are equal (NaN when none was accepted)."""
        return self.tp / (self.tp + self.fp) if self.tp + self.fp else math.nan

    @property
    def recall(self) -> float:
        """Of the equal rows, the share accepted (NaN when none is equal)."""
        return self.tp / (self.tp + self.fn) if self.tp + self.fn else math.nan


def scores(pairs: Sequence[Pair], said: Sequence[bool | Ungraded]) -> Scores:
    """The confusion counts of a checker's verdicts `said` against the pairs' labels.

    >>> p = [Pair("1", "1", True, "k"), Pair("1", "2", False, "k"), Pair("1", "1.0", True, "k")]
    >>> scores(p, [True, False, Ungraded("timeout")])
    Scores(tp=1, fp=0, fn=1, tn=1, ungraded={'timeout': 1})
    """
    accepted = [s is True for s in said]
    tp = sum(a and p.equivalent for a, p in zip(accepted, pairs))
    fp = sum(a and not p.equivalent for a, p in zip(accepted, pairs))
    positives = sum(p.equivalent for p in pairs)
    ungraded = Counter(s.reason for s in said if isinstance(s, Ungraded))
    return Scores(tp, fp, positives - tp, len(pairs) - positives - fp, dict(sorted(ungraded.items())))


class AuditResult(NamedTuple):
    overall: Scores
    by_added: dict[str, Scores]  # before_tuning / after_tuning (a user's `added`); empty where no row says
    by_kind: dict[str, Scores]  # the answer form; empty where no row says
    kind_added: dict[str, str]  # each kind's `added` (its first row's): where its line goes in the report


def _grouped(pairs: Sequence[Pair], said: Sequence[bool | Ungraded], key: Callable[[Pair], str]) -> dict[str, Scores]:
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(pairs):
        if key(p):
            groups.setdefault(key(p), []).append(i)
    return {g: scores([pairs[i] for i in rows], [said[i] for i in rows]) for g, rows in groups.items()}


def audit(check: Callable[[Sequence[Pair]], Verdicts], pairs: Sequence[Pair]) -> AuditResult:
    """`check`'s verdicts on `pairs`, counted overall, by when each pair was added, and by kind."""
    said = check(pairs)
    if len(said) != len(pairs):
        raise ValueError(f"the checker answered {len(said)} verdicts for {len(pairs)} pairs")
    kind_added = {}
    for p in pairs:
        kind_added.setdefault(p.kind, p.added)
    return AuditResult(scores(pairs, said), _grouped(pairs, said, lambda p: p.added),
                       _grouped(pairs, said, lambda p: p.kind), kind_added)


# ----------------------------------------------------------------------------------------------------------------
# The checkers


def as_completion(answer: str) -> str:
    """What the rule reads: the text as given when it has an answer block or a box, else the bare answer in the
    answer tags (a user's row may hold only "3/4")."""
    return answer if extract_answer(answer) is not None else f"<answer>{answer}</answer>"


def _verdicts(rewards: Sequence) -> Verdicts:
    out: Verdicts = []
    for r in rewards:
        if isinstance(r, Ungraded):
            out.append(r)
        elif r is None:
            out.append(Ungraded(UNREADABLE_REFERENCE, "no reference the rule can read"))
        else:
            out.append(r == 1.0)
    return out


def rule(pairs: Sequence[Pair], timeout_s: float = 5.0) -> Verdicts:
    """The accuracy reward's verdicts, each math check given `timeout_s` (then five times that, alone)."""
    return _verdicts(accuracy_reward([as_completion(p.completion) for p in pairs], [p.reference for p in pairs],
                                     timeout_s=timeout_s))


def math_verify_alone(pairs: Sequence[Pair]) -> Verdicts:
    """math-verify by itself: its own `parse` finds the answer in the reference and in the whole answer text."""
    import math_verify

    out: Verdicts = []
    for p in pairs:
        try:
            out.append(bool(math_verify.verify(math_verify.parse(p.reference), math_verify.parse(p.completion))))
        except Exception as e:  # its parser and verifier raise what their libraries raise
            out.append(Ungraded(RAISED, f"{type(e).__name__}: {e}"[:200]))
    return out


class Appeal(NamedTuple):
    judge: str  # where: "<model> at <base_url>"
    asked: int  # rows the rule rejected that went to the judge
    upheld: int  # of them, turned into acceptances
    no_verdict: dict[str, int]  # reason -> rows the judge gave no verdict for (the rule's 0.0 stands)
    rows: int  # rows audited

    @property
    def calls_per_1000_rows(self) -> float:
        return 1000 * self.asked / self.rows if self.rows else math.nan


class _Tallied:
    """A judge that counts the verdicts it could not give, by reason."""

    def __init__(self, judge):
        self.judge, self.no_verdict = judge, Counter()

    def judge_many(self, items):
        from grpo.sampling.judge import verdict_ungraded

        verdicts = self.judge.judge_many(items)
        self.no_verdict.update(verdict_ungraded(v) for v in verdicts if v.accepted is None)
        return verdicts


def rule_and_appeal(judge, timeout_s: float = 5.0) -> tuple[Callable[[Sequence[Pair]], Verdicts], Callable[[], dict]]:
    """The rule with its negatives appealed to `judge` (anything with `judge_many`), and a function that returns
    the appeal's figures so far: {"asked", "upheld", "no_verdict"}."""
    tallied = _Tallied(judge)
    reward = appealed(accuracy_reward, tallied)
    figures = {"asked": 0, "upheld": 0}

    def check(pairs: Sequence[Pair]) -> Verdicts:
        said = _verdicts(reward([as_completion(p.completion) for p in pairs], answer=[p.reference for p in pairs],
                                timeout_s=timeout_s))
        taken = reward.take_figures()
        figures["asked"] += int(taken["appeal_calls"])
        figures["upheld"] += int(taken["appeal_upheld"])
        return said

    return check, lambda: {**figures, "no_verdict": dict(sorted(tallied.no_verdict.items()))}


# ----------------------------------------------------------------------------------------------------------------
# The audit, and what it says


class VerifierAudit(NamedTuple):
    rows: int
    results: dict[str, AuditResult]  # checker name -> its result, in the order run
    appeal: Appeal | None  # the judge's work in "rule + appeal"; None where no judge was given
    note: str  # a line where a checker was skipped, else ""


def http_judge(cfg: JudgeConfig):
    """The OpenAI-compatible judge `cfg` names, checked to answer and to serve its model (JudgeUnavailable if not)."""
    from grpo.sampling.judge import HTTPJudge

    judge = HTTPJudge(cfg)
    judge.check_available()
    return judge


def audit_verifiers(pairs: Sequence[Pair], judge_cfg: JudgeConfig | None = None, *,
                    timeout_s: float = 5.0) -> VerifierAudit:
    """The rule, math-verify alone and, with `judge_cfg` (an http judge), rule + appeal, each on `pairs`.
    The judge is checked before any grading: one that does not answer raises JudgeUnavailable at once."""
    judge = http_judge(judge_cfg) if judge_cfg is not None else None
    results = {RULE: audit(lambda ps: rule(ps, timeout_s), pairs), MATH_VERIFY: audit(math_verify_alone, pairs)}
    if judge is None:
        return VerifierAudit(len(pairs), results, None, f"{RULE_AND_APPEAL}: skipped, no judge given (--judge URL, "
                                                        "or a recipe whose reasoning_grpo.grpo.grading.appeal or "
                                                        "rejection_sampling.judge is an http endpoint)")
    check, figures = rule_and_appeal(judge, timeout_s)
    results[RULE_AND_APPEAL] = audit(check, pairs)
    f = figures()
    appeal = Appeal(f"{judge_cfg.model!r} at {judge_cfg.base_url}", f["asked"], f["upheld"], f["no_verdict"],
                    len(pairs))
    return VerifierAudit(len(pairs), results, appeal, "")


def _counted(counts: dict[str, int]) -> str:
    return ", ".join(f"{reason} {n}" for reason, n in counts.items())


def _line(name: str, s: Scores) -> str:
    ungraded = sum(s.ungraded.values())
    why = f" ({_counted(s.ungraded)})" if ungraded else ""
    return (f"{name:<26}{s.precision:>9.3f}{s.recall:>8.3f}{s.tp:>6}{s.fp:>6}{s.fn:>6}{s.tn:>6}"
            f"{s.tp + s.fp + s.fn + s.tn:>6}  {ungraded}{why}")


def report_text(result: VerifierAudit, by_kind: bool = False) -> str:
    """A table: each checker's precision, recall, TP/FP/FN/TN and ungraded rows (with reasons), overall and by when
    the rows were added (and by kind, with `by_kind`); then the appeal's work, or why it was skipped."""
    lines = [f"{'checker':<26}{'precision':>9}{'recall':>8}{'TP':>6}{'FP':>6}{'FN':>6}{'TN':>6}{'rows':>6}  ungraded"]
    for name, r in result.results.items():
        lines.append(_line(name, r.overall))
        for added, s in [*r.by_added.items(), ("", None)]:  # then the kinds of rows that name no `added`
            if s is not None:
                lines.append(_line(f"  {added}", s))
            if by_kind:
                lines += [_line(f"    {kind}", k) for kind, k in r.by_kind.items() if r.kind_added[kind] == added]
    a = result.appeal
    if a is not None:
        no_verdict = sum(a.no_verdict.values())
        lines.append(f"{RULE_AND_APPEAL}: judge {a.judge} asked about {a.asked} of {a.rows} rows "
                     f"({a.calls_per_1000_rows:.1f} calls per 1,000 rows), upheld {a.upheld}, no verdict "
                     f"{no_verdict}" + (f" ({_counted(a.no_verdict)})" if no_verdict else ""))
    if result.note:
        lines.append(result.note)
    return "\n".join(lines)


def _figures(s: Scores) -> dict:
    return {"precision": round(s.precision, 4), "recall": round(s.recall, 4), "tp": s.tp, "fp": s.fp, "fn": s.fn,
            "tn": s.tn, "ungraded": s.ungraded}


def report_figures(result: VerifierAudit) -> dict:
    """The same as a JSON-ready dict: rows, then per checker its figures and its figures by `added`; the appeal's."""
    out: dict = {"rows": result.rows}
    for name, r in result.results.items():
        out[name] = {**_figures(r.overall), **{added: _figures(s) for added, s in r.by_added.items()}}
    if result.appeal is not None:
        a = result.appeal
        out["appeal"] = {"asked": a.asked, "upheld": a.upheld, "no_verdict": a.no_verdict,
                         "calls_per_1000_rows": round(a.calls_per_1000_rows, 1)}
    return out
