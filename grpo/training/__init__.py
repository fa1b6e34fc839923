"""Training: the parts every loop shares, loose in this folder; the loops in `loops/`; the job runner (`jobs`); what
starts them in `launchers/`; asynchronous rollouts in `rollouts/`.

A loop (`loops/`) is a whole training run of one kind (SFT, GRPO, PPO, the reward model, DPO, the PRM); the job runner
(`jobs`) builds a loop from its typed job; a launcher (`launchers/`) runs a job in other processes or machines; the
samplers apart from the trainer (processes or Ray actors) are `rollouts/`; everything else here is a part a loop is
built from:

| module | what it holds |
|---|---|
| `loops/` | the loops, a whole training run of one kind each: SFT, GRPO, PPO, the reward model, DPO, the PRM |
| `jobs` | the job runner: one typed job per loop (`SFTJob`, `GRPOJob`, `RewardModelJob`, `DPOJob`) and `run(job, callbacks)`, which builds the loop's model, engine and reference from it and trains |
| `launchers/` | what runs a job in other processes or on other machines (`accelerate launch`, a multi-machine job, Ray Train) |
| `rollouts/` | asynchronous rollouts: samplers apart from the trainer (processes or Ray actors), at most `max_staleness` steps behind |
| `loss` | `grpo_loss`: the clipped surrogate with the k3 KL penalty and its loss-type reductions |
| `advantages` | `group_advantages`: (r - group mean) / group std, and its variants |
| `process` | process supervision: step rewards normalised over the group, token advantages `[N, C]` from step ends |
| `rft` | online RFT's gradient coefficient (1 for a correct sample, 0 otherwise), which GRPO's loop trains with in place of advantages |
| `ppo`, `value` | PPO's pure parts: GAE and the clipped losses, the value model |
| `dynamic` | DAPO's dynamic sampling: groups whose rewards differ, kept from several draws into one batch |
| `policy` | the functions GRPO's and PPO's loops share: the trainable policy with its optimizer, the frozen reference, a step's rollout sampled and scored, log-probs without gradients |
| `runtime` | `PolicyRuntime`: the policy as GRPO's and PPO's loops train it, set up once (accelerator, strategy, trainable policy, reference, GEMM plan, grading watch) |
| `sources` | a GRPO loop's rollout source: the engine in the loop, dynamic sampling's refill; `rollout_source` picks one (asynchronous samplers: `rollouts.source`) |
| `credit` | a GRPO loop's advantage function: the group outcome, process supervision, RFT's coefficients; `advantage_function` picks one |
| `step_batch` | a GRPO step's batch (advantages, pi_old's and the reference's log-probs, the tokens that count) and its clipped update in micro-batches |
| `parts` | `grpo_parts`: the runtime, rollout source and advantage the job runner builds and hands a GRPO loop |
| `hooks` | `StepHook`: work a GRPO loop runs after every step with its samples |
| `logprobs` | per-token log-probs of completions, with a group's shared prompt run once (chunked head for large vocabularies) |
| `sft_rows` | SFT rows as tokens: a frame in memory, or Parquet files (the curated dataset) tokenized once (each process of a launch its share) into Arrow files read a row at a time |
| `batches` | which rows a step takes (`batch_indices`, `prompt_order`; `mixed_order`: a set share of each kind every step) and token lists padded into tensors (`pad_right`) |
| `alignment_watch` | the alignment stage's true score beside its reward models' while GRPO runs, and the line when one falls while the other rises |
| `reward_scorer` | the Bradley-Terry reward model's parts: its loss, the model, the encoding, the scorer as a reward function |
| `checkpoints` | resumable checkpoints of the loops, written whole (manifest last) and verified before loading; folder manifests |
| `accelerator` | the Accelerator every loop starts from, and the fp32 GEMM plan its processes share |
| `optimizers` | AdamW (fused), 8-bit AdamW, fp32 master weights, and the clip/step/zero sequence every loop shares |
| `schedules` | learning-rate schedules by name, transformers' own without importing `transformers.optimization` (which loads peft and bitsandbytes) |
| `distributed` | training across processes: each process's share of a global batch, global loss weights, reduced metrics |
| `strategy` | how the processes hold a model (`ddp` or `fsdp`): its distributed form, whole weights back (GRPO's sampler, the final checkpoint), resume checkpoints |
| `lora` | LoRA adapters on the policy: added, switched off for the reference, merged for the next stage |
| `precision` | `auto`/`bf16`/`fp16`/`no` resolved against the hardware (bf16 only where it is native) |
| `grading` | the run's grading watch: a stop when graders keep failing (ungraded rows), a line when groups stop carrying signal |
| `appeal` | a second look at the rule's negatives: a judge, given the reference, may turn a right answer the rule missed |
| `packing` | padding-free rows: sequences one after another, micro-batches filled to a token budget |
| `verifier_audit` | the answer checkers (the rule, math-verify alone, rule + appeal) scored on labelled pairs: TP/FP/FN/TN, ungraded rows, the judge's calls; what `r1 audit-rewards` prints |

Imports point one way: configs <- grpo's data, rewards, kernels, models, sampling <- these parts <- loops <- the job
runner <- launchers (tests/test_layers.py holds it: no part imports a loop, the job runner or a launcher; no loop
imports another loop).
Must not depend on Prefect or MLflow: loops report through callbacks.
"""
