"""The training loops: each reads top to bottom (set up, a plain `for step` loop, save) and is run by a stage.

| module | the loop |
|---|---|
| `sft_trainer` | SFT of stages 1 and 4 (`train_sft`) |
| `grpo_trainer` | GRPO of stages 2 and 5: sample, score, advantages, optimise (`GRPOTrainer`), with step hooks; online RFT trains through it with its coefficients (grpo.training.rft) |
| `ppo_trainer` | PPO with a critic, GRPO's measured baseline (`PPOTrainer`), on the same rollout and policy parts |
| `reward_model` | the Bradley-Terry reward model of stage 5 (`train_reward_model`) |
| `rm_refresh` | the iterative reward model: pairs from the policy's groups, trained as GRPO's step hook |
| `dpo` | DPO for stage 5 (`algorithm: dpo`): the sigmoid and IPO losses (pure) and the loop (`train_dpo`) |
| `prm` | the process reward model: Math-Shepherd step labels from rollouts, its training, its use as a step verifier |

May import configs (`grpo.configs.*`), grpo's data, rewards, kernels, models and sampling, and the
training parts beside this folder (`grpo.training.*`). No loop imports another loop, nor a launcher: what two
loops share is a part (tests/test_layers.py holds this). Must not depend on Prefect or MLflow: loops report
through callbacks.
"""
