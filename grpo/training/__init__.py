"""Training: the GRPO objective and advantages (pure tensor functions), log-probs, and the training loops.

| module | what it holds |
|---|---|
| `loss` | `grpo_loss`: the clipped surrogate with the k3 KL penalty and its loss-type reductions |
| `advantages` | `group_advantages`: (r - group mean) / group std, and its variants |
| `process` | process supervision: step rewards normalised over the group, token advantages `[N, C]` from step ends |
| `prm` | the process reward model: Math-Shepherd step labels from rollouts, training, and use as a step verifier |
| `logprobs` | per-token log-probs of completions, with a group's shared prompt run once (chunked head for large vocabularies) |
| `grpo_trainer` | the GRPO loop: sample, score, advantages, optimise (`GRPOTrainer`), with step hooks |
| `dynamic` | DAPO's dynamic sampling: groups whose rewards differ, kept from several draws into one batch |
| `ppo`, `value`, `ppo_trainer` | PPO with a critic, GRPO's measured baseline: GAE and the clipped losses (pure), the value model, the loop (`PPOTrainer`) |
| `sft_trainer` | the SFT loop of stages 1 and 4 (`train_sft`) |
| `reward_model` | the Bradley-Terry reward model of stage 5, trained and used as a reward function |
| `rm_refresh` | the iterative reward model: pairs from the policy's groups, the refresh GRPO's step hook runs |
| `rft` | online RFT's gradient coefficient (1 for a correct sample, 0 otherwise), which GRPO's loop trains with in place of advantages |
| `dpo` | DPO for stage 5 (`algorithm: dpo`): the sigmoid and IPO losses (pure) and the loop (`train_dpo`) |
| `checkpoints` | resumable checkpoints of the loops, written whole (manifest last) and verified before loading; folder manifests |
| `accelerator` | the Accelerator, the optimizer and the clip/step/zero sequence every loop shares |
| `schedules` | learning-rate schedules by name, transformers' own without importing `transformers.optimization` (which loads peft and bitsandbytes) |
| `distributed` | training across processes: each process's share of a global batch, global loss weights, reduced metrics |
| `strategy` | how the processes hold a model (`ddp` or `fsdp`): its distributed form, whole weights back (GRPO's sampler, the final checkpoint), resume checkpoints |
| `launch`, `worker`, `join`, `ray_train` | a stage's loop in launched processes: the task's launch, what each process runs, what a job's other machines run, Ray Train workers on a Ray cluster |
| `precision` | `auto`/`bf16`/`fp16`/`no` resolved against the hardware (bf16 only where it is native) |

Must not depend on Prefect or MLflow: loops report through callbacks.
"""
