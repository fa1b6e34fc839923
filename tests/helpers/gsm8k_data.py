"""Rows in GSM8K's own format, and the dataset card that lays a local copy out as the hub's openai/gsm8k (conftest's
`gsm8k_copy` writes one)."""

from __future__ import annotations


def gsm8k_rows(n: int, start: int = 0) -> list[dict]:
    """Rows in GSM8K's own format: `question`, and `answer` a worked solution with calculator notes whose last
    line is `#### <number>` (thousands written with commas)."""
    rows = []
    for i in range(start, start + n):
        cows, bought, months = 3 + i, 2 + i % 5, 200 + 7 * i
        new = bought * months
        total = cows + new
        rows.append({
            "question": f"A farm has {cows} cows. It buys {bought} cows a month for {months} months. "
                        f"How many cows does it have then?",
            "answer": f"It buys {bought}*{months} = <<{bought}*{months}={new}>>{new} cows.\n"
                      f"It has {cows}+{new} = <<{cows}+{new}={total}>>{total} cows.\n#### {total:,}",
        })
    return rows


GSM8K_README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
---
"""
