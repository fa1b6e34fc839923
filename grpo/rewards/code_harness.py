"""The test harness that runs inside the sandbox: the program, then one test, then the test's value on stdout.

This file's text is sent into the sandbox and run there by a fresh interpreter (`grpo.rewards.sandbox`), one
process per test; it is imported nowhere. It must use the standard library only and nothing of this project, and
it decides nothing: it prints what the test evaluated to, as plain data, and the caller (`grpo.rewards.code`)
compares that with the expected value outside the program's interpreter.

argv[1] is the job, JSON: {"nonce": str, "program": str, "setup": str, "kind": ..., ...} where kind is
  "value" (evaluate "expr"), "pair" (evaluate "left" and "right"), "truth" (evaluate "expr") or
  "run" (execute "code"; its value is null when it completes).
It prints one line: "<nonce> " + JSON, either {"value": <encoded>} or {"error": "<what went wrong>"}, then leaves
at once (os._exit), so nothing the program registered (atexit, threads) runs after it.

Encoded values are plain data only, with exact types (a subclass of int or an object with its own __eq__ is not
plain data and fails the test): ["N"] None, ["b", bool], ["i", hex], ["f", repr], ["c", re, im], ["s", str],
["y", hex of bytes], ["l" | "t" | "S" | "F", [items]] list, tuple, set, frozenset, ["d", [[key, value], ...]].
"""

import builtins
import json
import os
import sys

# Taken before the program runs, so a program that rebinds the names (builtins.type, sys.stdout, os.write) changes
# nothing here. It could still reach into this interpreter and claim any value it likes: the caller compares that
# value with the expected one, so a claim passes only when it is the right answer (see grpo.rewards.code).
_type, _repr, _hex, _len, _isinstance = type, repr, hex, len, isinstance
_write, _exit, _dumps = os.write, os._exit, json.dumps
_MAX_ITEMS = 100_000  # values larger than this are not worth sending back
_MAX_DEPTH = 100


class NotPlainData(Exception):
    pass


def encode(value, depth=0, budget=None):
    """`value` as JSON-able nested lists, raising NotPlainData for anything else."""
    budget = budget if budget is not None else [_MAX_ITEMS]
    budget[0] -= 1
    if budget[0] < 0 or depth > _MAX_DEPTH:
        raise NotPlainData("value too large or too deeply nested")
    t = _type(value)
    if value is None:
        return ["N"]
    if t is bool:
        return ["b", value]
    if t is int:
        return ["i", _hex(value)]  # hex: no limit on digits, unlike str(int)
    if t is float:
        return ["f", _repr(value)]
    if t is complex:
        return ["c", _repr(value.real), _repr(value.imag)]
    if t is str:
        return ["s", value]
    if t is bytes:
        return ["y", value.hex()]
    if t in (list, tuple, set, frozenset):
        tag = {list: "l", tuple: "t", set: "S", frozenset: "F"}[t]
        return [tag, [encode(v, depth + 1, budget) for v in value]]
    if t is dict:
        return ["d", [[encode(k, depth + 1, budget), encode(v, depth + 1, budget)] for k, v in value.items()]]
    raise NotPlainData(f"a {t.__name__!s:.40} is not plain data (None, bool, int, float, complex, str, bytes, "
                       f"list, tuple, set, frozenset, dict)")


def report(fd, nonce, result):
    line = "\n" + nonce + " " + _dumps(result) + "\n"
    _write(fd, line.encode("utf-8", "backslashreplace"))


def main():
    job = json.loads(sys.argv[1])
    out = os.dup(1)  # the program may close or redirect fd 1; the result still gets out
    namespace = {"__name__": "solution", "__builtins__": builtins}
    try:
        exec(compile(job["program"], "solution.py", "exec"), namespace)
        if job.get("setup"):
            exec(compile(job["setup"], "setup.py", "exec"), namespace)
        kind = job["kind"]
        if kind in ("value", "truth"):
            result = {"value": encode(eval(job["expr"], namespace))}
        elif kind == "pair":
            left = encode(eval(job["left"], namespace))
            result = {"value": ["t", [left, encode(eval(job["right"], namespace))]]}
        else:
            exec(compile(job["code"], "test.py", "exec"), namespace)
            result = {"value": ["N"]}
    except SystemExit:
        result = {"error": "the program exited before the test finished"}
    except BaseException as e:  # noqa: BLE001 - whatever the program raised is the test's failure
        try:
            result = {"error": f"{_type(e).__name__}: {e}"[:300]}
        except BaseException:  # noqa: BLE001 - an exception whose str() raises
            result = {"error": "an exception that cannot be shown"}
    report(out, job["nonce"], result)
    _exit(0)


if __name__ == "__main__":
    main()
