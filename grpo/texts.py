"""The response format and the prompt texts that several modules share.

R1's completions read `<think>reasoning</think><answer>final answer</answer>`. The rewards, the synthetic data, the
rejection filters, the tiny tokenizer's corpus and the judge all read or write that shape, so it is written down
once, here. This module imports nothing of the project's and nothing beyond the standard library: anything may
import it.
"""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
THINK_TAGS = (THINK_OPEN, THINK_CLOSE)
ANSWER_TAGS = (ANSWER_OPEN, ANSWER_CLOSE)
REASONING_TAGS = THINK_TAGS + ANSWER_TAGS  # in the order a well-formed response has them


def render_response(think: str, answer: str) -> str:
    """A response in the R1 format, with no whitespace around the tags (as the synthetic data writes it)."""
    return f"{THINK_OPEN}{think}{THINK_CLOSE}{ANSWER_OPEN}{answer}{ANSWER_CLOSE}"


# The judge's question (grpo.sampling.judge). Kept short: the tiny models read every word of it on every call, and
# the tiny tokenizer learns its words (grpo.tiny), so the two must read the same text.
JUDGE_PROMPT = """Is the response's final answer to the question correct? Compare it with the reference answer.

Question:
{question}

Reference answer:
{reference}

Response:
{response}

Reply with exactly two lines:
VERDICT: yes or no
REASON: one short sentence"""

JUDGE_TEMPLATE_FIELDS = frozenset({"question", "reference", "response"})  # what a judge template may name
NO_REFERENCE = "(none given: judge the response on its own)"  # stands in for a missing reference answer
