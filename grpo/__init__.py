"""The GRPO core: plain PyTorch and transformers, no Prefect, no MLflow (tests/test_layers.py holds it to that).

Where things are:

| module | what it holds |
|---|---|
| `config`, `recipe` | every setting as a frozen pydantic model; the stage configs, the recipe and reading a recipe file (no torch) |
| `ppo_config` | the settings of PPO with a critic, which the reasoning stage runs with `algorithm: ppo` (no torch) |
| `rft_config` | the settings of online RFT, which the reasoning stage runs with `algorithm: online_rft` (no torch) |
| `dpo_config` | the settings of DPO, which the alignment stage runs with `algorithm: dpo` (no torch) |
| `checks` | checks that span several settings, the precision setting's type, pydantic errors on one line |
| `texts` | the `<think>`/`<answer>` response format and the prompt texts several modules share |
| `models`, `tiny` | loading models by name or path; the embedded tiny model and its locally made tokenizer |
| `data/` | the synthetic arithmetic task, loading and validating user datasets, preference pairs |
| `rewards/` | rule rewards (format, accuracy, language, overlong) and the registry that scores with weights |
| `training/` | the GRPO loss and advantages, online RFT's coefficient, per-token log-probs, and the GRPO, PPO, SFT, reward-model and DPO loops |
| `sampling/` | generation behind one interface (backends and decoders), the LLM judge, the chat server |
| `rejection/` | rejection sampling: readability filters, curation, sharded and resumable sampling |
| `kernels/` | speed and memory tricks that keep the model's own numbers (attention, SwiGLU) |
| `evaluate` | held-out accuracy, format rate and pass@k of a checkpoint; the alignment stage's refusal figures |

Imports point one way: `config`, `checks` and `texts` import nothing heavy; `data`, `rewards` and `rejection.filters` are
pure Python and pandas; `training` and `sampling` are where torch lives.
"""
