"""Data: the synthetic reasoning task, user datasets checked before training, and preference pairs.

| module | what it holds |
|---|---|
| `arithmetic` | the synthetic multi-step arithmetic word problems with worked chains of thought |
| `tables` | reading user files and hub datasets, schema checks that name the file, row and column |
| `formats` | answer formats (`plain`, `gsm8k`, `boxed`): the reference answer and the worked solution in a cell |
| `preferences` | general prompts and chosen/rejected pairs for the alignment stage's reward model |

Pure Python and pandas: must not depend on torch, Prefect or MLflow.
"""
