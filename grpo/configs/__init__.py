"""Every setting as a frozen pydantic model: the recipe, its stage configs and their sections.

Plain pydantic, no torch, and nothing of the project above it: a module here imports only this package and
`grpo.texts` (tests/test_layers.py holds it to that), so a recipe is read and checked before anything heavy loads, and
every layer above can import it. Where a setting names something a layer above defines (a rule reward, a language,
a code language), the names are kept here and that layer checks on import that it offers exactly these.

| module | what it holds |
|---|---|
| `recipe` | the recipe, its stage configs, reading a recipe file and its overrides |
| `model` | which model a stage starts from (`ModelConfig`), the embedded tiny model's shape (`TinyModelConfig`) |
| `data` | where rows come from (`DataConfig`), the synthetic task (`TaskConfig`) |
| `sampling` | sampling settings (`SamplingConfig`), the engine (`GenerationConfig`), held-out evaluation (`EvalConfig`) |
| `grading` | the rule rewards, step verifiers and languages a recipe may name, the judge (`JudgeConfig`) |
| `training` | the SFT (`SFTConfig`) and GRPO (`GRPOConfig`: `optimizer`, `loss`, `memory`, `grading` sections) loops, the learning-rate schedulers, GRPO's flat names before its sections (`MOVED_KEYS`) |
| `rejection` | rejection sampling (`RejectionConfig`), where its shards run (`ClusterConfig`) |
| `code`, `lora`, `rollout`, `schedule` | sections of the above: the code reward, LoRA, rollouts, what changes mid-run |
| `ppo`, `rft`, `dpo`, `reward`, `alignment` | other algorithms' settings and the alignment stage's |
| `distributed`, `budget`, `sweep` | processes and machines, rejection sampling's plan, `r1 sweep`'s points |
| `checks` | checks spanning several fields, pydantic errors as one line, a recipe's flat GRPO names put in their sections (`sectioned`) |
"""
