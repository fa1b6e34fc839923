"""Data: the synthetic reasoning task, user datasets checked before training, and preference pairs.

| module | what it holds |
|---|---|
| `arithmetic` | the synthetic multi-step arithmetic word problems with worked chains of thought |
| `tables` | reading user files and hub datasets, schema checks that name the file, row and column |
| `row_files` | datasets kept as Parquet files (a folder of part files, or one file): listed, checked a batch at a time, described (rows, digest, columns) |
| `formats` | answer formats (`plain`, `gsm8k`, `boxed`): the reference answer and the worked solution in a cell |
| `general` | the general requests (harmful, benign, borderline) of the alignment stage and the SFT mix: three splits, each prompt's true label and reference, the rules that read a response (`is_refusal`, `is_helpful`), a user's evaluation set |
| `concepts` | per general subject, the word stems a right answer in any words is likely to use (what `is_helpful` reads of an answer in a model's own words) |
| `unlike_requests` | requests written unlike the generator's (other kinds of harm, other lengths), the alignment stage's third evaluation set |
| `preferences` | chosen/rejected pairs for the alignment stage's reward models, and a user's pairs |

Pure Python and pandas: must not depend on torch, Prefect or MLflow.
"""
