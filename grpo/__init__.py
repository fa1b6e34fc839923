"""The GRPO core: plain PyTorch and transformers, no Prefect, no MLflow (tests/test_layers.py holds it to that).

Where things are:

| module | what it holds |
|---|---|
| `configs/` | every setting as a frozen pydantic model, a module a topic (`recipe`: the stage configs, the recipe and reading a recipe file; `model`, `data`, `sampling`, `grading`, `training`, `rejection`: a stage's sections; `ppo`, `rft`, `dpo`, `reward`, `alignment`: the other algorithms and the alignment stage; `code`, `lora`, `rollout`, `schedule`, `distributed`, `budget`, `sweep`), and `checks`, those that span several settings and pydantic errors on one line; no torch, and nothing of the project above it |
| `texts` | the `<think>`/`<answer>` response format and the prompt texts several modules share |
| `models`, `tiny` | loading models by name or path; the embedded tiny model and its locally made tokenizer |
| `model_files` | a model that comes as one file (a GGUF path, or a file inside an installed package): found, and dequantized once into the model cache |
| `data/` | the synthetic arithmetic task, loading and validating user datasets, preference pairs |
| `rewards/` | rule rewards (format, accuracy, language, overlong) and the registry that scores with weights |
| `training/` | the parts every loop shares (the GRPO loss and advantages, online RFT's coefficient, per-token log-probs, grading, packing, ...), the loops (GRPO, PPO, SFT, reward model, DPO, PRM) in `loops/`, the job runner that builds one (`jobs`), asynchronous rollouts (`rollouts/`) and what starts loops in other processes or machines (`launchers/`) |
| `sampling/` | generation behind one interface (the local paged engine in `local/`, the http engine, OpenAI-compatible requests), the LLM judge (the chat server `r1 serve` runs is `flows/cli/serve.py`, over this engine) |
| `rejection/` | rejection sampling: readability filters, curation, sharded and resumable sampling |
| `kernels/` | speed and memory tricks that keep the model's own numbers (attention, SwiGLU) |
| `evaluate` | held-out accuracy, format rate and pass@k of a checkpoint; the alignment stage's measures (harmful refused, benign helpful, borderline refused, handled right) and their paired comparison |
| `stats` | a before -> after change of a share on the same prompts: its paired 95% interval (Agresti-Min) and McNemar's exact p |
| `startup` | a process's start-up without the cyclic garbage collector: its imports, then one collection and a freeze |
| `cores` | threads that fit the cores where the project starts processes side by side |
| `extras` | the one check that a setting's optional packages (peft, bitsandbytes, Ray) are installed |
| `faults` | a full disk or a damaged file, each told in one line |
| `interrupts` | Ctrl-C or SIGTERM: a run stopped within seconds, its MLflow runs ended KILLED |
| `ports` | a free port for a server, a rendezvous or a cluster node |
| `sweep` | a sweep's grid of settings times seeds |

Imports point one way: `configs/` imports only itself and `texts`, neither anything heavy; `data`, `rewards` and `rejection.filters` are
pure Python and pandas; `training` and `sampling` are where torch lives.
"""
