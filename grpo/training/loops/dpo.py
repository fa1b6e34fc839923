"""DPO for the alignment stage: train the policy on preference pairs directly, with no reward model and no sampling.

In DeepSeekMath's unified view (`grpo.training.rft`) DPO is the offline member: its data are fixed pairs
(q, o+, o-) of a chosen and a rejected response, and its gradient coefficient comes from a comparison with a frozen
reference π_ref (the stage's starting checkpoint). With the sequence log-ratios

    h(q, o) = log πθ(o | q) - log π_ref(o | q)       (a sum over the response's tokens)
    m       = h(q, o+) - h(q, o-)                     (the pair's margin)

the losses over a batch of pairs are (`LOSSES`):

    sigmoid (DPO, Rafailov et al. 2023):  L = mean[ -log σ(β·m) ]
    ipo     (IPO, Azar et al. 2023):      L = mean[ (m - 1/(2β))² ]

DPO's gradient pushes log πθ(o+) up and log πθ(o-) down with the weight σ(-β·m): large while the policy still ranks
the pair wrong against the reference, vanishing once it ranks it right by a wide margin, which lets the margin grow
without bound on separable pairs. IPO's squared loss pulls the margin to the target 1/(2β) and stops there. β·h is
DPO's implicit reward, logged as `dpo/chosen_reward` and `dpo/rejected_reward`; `dpo/accuracy` is the share of
pairs with m > 0. IPO's paper writes h with the sequence's summed log-probs, as here (some libraries average over
tokens instead).

The loop is the reward model's (`grpo.training.loops.reward_model`) with a policy in place of a scorer: pairs tokenized
up front (a pair too long fails before training), micro-batches drawn by step (a resumed run sees the batches it
would have seen), chosen and rejected rows in one forward with the prompt shared (`token_logps`: the prompt pass is
made once for both), the reference's log-probs computed without gradients in the same micro-batch (a frozen whole
copy, or with LoRA the policy with its adapters off), resumable checkpoints every `checkpoint_every` steps, and the
model held through the distributed strategy (`grpo.training.strategy`: ddp or fsdp, the loop never asks which). Under
`accelerate launch --num_processes N` each process takes 1/N of every micro-batch's pairs; every pair weighs the same,
so DDP's mean over processes is the one-process gradient. Where `packing` allows, a micro-batch's rows go through
the policy and the reference as one row without padding (`token_logps(packed=True)`), the padded numbers to float
rounding.

Run it alone:
    from grpo.configs.dpo import DPOConfig
    from grpo.configs.model import ModelConfig
    from grpo.data.preferences import preference_pairs
    from grpo.models import load_model_and_tokenizer
    from grpo.training.loops.dpo import train_dpo
    model, tokenizer = load_model_and_tokenizer(ModelConfig(name_or_path="<sft checkpoint folder>"))
    result = train_dpo(model, tokenizer, preference_pairs(1000), DPOConfig(), "out/dpo",
                       heldout=preference_pairs(200, split="heldout"))

Must not depend on Prefect or MLflow: metrics go to a callback.
"""

from __future__ import annotations

import copy
import math
import random
import shutil
import time
from pathlib import Path
from typing import Callable, NamedTuple

import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo.configs.distributed import DistributedConfig
from grpo.configs.dpo import DPOConfig
from grpo.data.preferences import split_by_prompt
from grpo.data.tables import DataError
from grpo.kernels.attention import attending_packed, cpu_attention
from grpo.kernels.mlp import compact_mlp
from grpo.models import activation_checkpointing
from grpo.rewards import completion_text
from grpo.sampling.local import render_prompts, response_text
from grpo.training.accelerator import make_accelerator
from grpo.training.batches import batch_indices
from grpo.training.checkpoints import load_newest_checkpoint, save_checkpoint
from grpo.training.distributed import check_split, main_only, process_share, reduce_metrics
from grpo.training.logprobs import packing_on, token_logps
from grpo.training.lora import adapters_off, add_lora, causal_lm, require_peft, save_merged
from grpo.training.optimizers import make_adamw, optimizer_step
from grpo.training.schedules import make_scheduler
from grpo.training.strategy import make_strategy

MetricsCallback = Callable[[int, dict[str, float]], None]


class PairTokens(NamedTuple):
    prompt_ids: list[int]  # the chat-formatted prompt, ending where the assistant's turn starts
    chosen_ids: list[int]  # the chosen response as the template closes the turn (end-of-turn marker included)
    rejected_ids: list[int]  # the rejected response, the same way


class PairBatch(NamedTuple):
    """B pairs as 2B rows: rows [0, B) the chosen responses, [B, 2B) their rejected partners."""

    input_ids: torch.Tensor  # [2B, P+C] prompt (left-padded) then response (right-padded)
    attention_mask: torch.Tensor  # [2B, P+C]
    response_mask: torch.Tensor  # [2B, C] float: the response's tokens


class DPOResult(NamedTuple):
    model_dir: Path  # the trained policy (merged weights with LoRA), loadable with from_pretrained
    steps: int  # optimizer steps taken in total (including resumed ones)
    final_loss: float  # mean DPO loss over the last logging window
    heldout_metrics: dict[str, float]  # dpo/heldout_accuracy and dpo/heldout_margin (nan without held-out pairs)
    seconds: float  # wall time of the training loop (this run's part of it)


# ----------------------------------------------------------------------------------------------------------------
# The loss


def _sigmoid_loss(margins: torch.Tensor, beta: float) -> torch.Tensor:
    """-log σ(β·m) per pair (DPO)."""
    return -F.logsigmoid(beta * margins)  # [B]


def _ipo_loss(margins: torch.Tensor, beta: float) -> torch.Tensor:
    """(m - 1/(2β))² per pair (IPO): the margin is pulled to its target, not beyond."""
    return (margins - 1 / (2 * beta)) ** 2  # [B]


LOSSES: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {"sigmoid": _sigmoid_loss, "ipo": _ipo_loss}


def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, *, beta: float = 0.1,
             loss_type: str = "sigmoid") -> tuple[torch.Tensor, dict[str, float]]:
    """The mean loss over a batch of pairs and detached stats; every argument is [B], a sequence's summed log-prob.
    The reference's log-probs are constants (detached).

    Stats (python floats): dpo/accuracy (share of pairs with margin > 0; a tie is a miss), dpo/margin (the mean of
    β·m, the implicit reward's margin), dpo/chosen_reward and dpo/rejected_reward (the means of β·h).

    Worked example: the policy gives the chosen response 1 nat more than the reference does and the rejected 1 nat
    less, so m = 2; with β = 0.5 the loss is -log σ(1) ≈ 0.3133.
    >>> loss, stats = dpo_loss(torch.tensor([-4.0]), torch.tensor([-6.0]), torch.tensor([-5.0]),
    ...                        torch.tensor([-5.0]), beta=0.5)
    >>> round(loss.item(), 4), stats["dpo/margin"]
    (0.3133, 1.0)
    """
    if loss_type not in LOSSES:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {sorted(LOSSES)}")
    chosen = chosen_logps - ref_chosen_logps.detach()  # [B] h(q, o+)
    rejected = rejected_logps - ref_rejected_logps.detach()  # [B] h(q, o-)
    margins = chosen - rejected  # [B]
    loss = LOSSES[loss_type](margins, beta).mean()
    with torch.no_grad():
        stats = {"dpo/accuracy": (margins > 0).float().mean().item(),
                 "dpo/margin": (beta * margins).mean().item(),
                 "dpo/chosen_reward": (beta * chosen).mean().item(),
                 "dpo/rejected_reward": (beta * rejected).mean().item()}
    return loss, stats


# ----------------------------------------------------------------------------------------------------------------
# Pairs to token ids, and batches


def tokenize_pairs(pairs: pd.DataFrame, tokenizer: PreTrainedTokenizerBase, max_seq_len: int,
                   source: str = "pairs") -> list[PairTokens]:
    """Every pair as token ids; one whose prompt + response does not fit fails here, before any training (cutting
    it would train on a response that ends elsewhere than the person's)."""
    rendered = render_prompts(tokenizer, pairs["prompt"].tolist())
    out = []
    for i, (cell, prompt) in enumerate(zip(pairs["prompt"].tolist(), rendered)):
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        responses = []
        for col in ("chosen", "rejected"):
            text = response_text(tokenizer, cell, prompt, completion_text(pairs[col].iloc[i]))
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(prompt_ids) + len(ids) > max_seq_len:
                raise DataError(f"{source}: row {i}, column {col!r}: prompt + response is {len(prompt_ids) + len(ids)} "
                                f"tokens; expected at most dpo.max_seq_len={max_seq_len}")
            responses.append(ids)
        out.append(PairTokens(prompt_ids, *responses))
    return out


def pair_batch(pairs: list[PairTokens], pad_id: int) -> PairBatch:
    """B pairs as 2B rows (chosen, then rejected), prompts left-padded to one width and responses right-padded to
    another, so every response starts at the same column and `token_logps` reads the last C of each row."""
    prompts = [p.prompt_ids for p in pairs] * 2
    responses = [p.chosen_ids for p in pairs] + [p.rejected_ids for p in pairs]
    P, C = max(map(len, prompts)), max(map(len, responses))
    ids = torch.full((len(prompts), P + C), pad_id)  # [2B, P+C]
    mask = torch.zeros((len(prompts), P + C), dtype=torch.long)  # [2B, P+C]
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, P - len(p) : P] = torch.tensor(p)
        ids[i, P : P + len(r)] = torch.tensor(r)
        mask[i, P - len(p) : P + len(r)] = 1
    return PairBatch(ids, mask, mask[:, P:].float())


def sequence_logps(model: torch.nn.Module, batch: PairBatch, packed: bool = False) -> torch.Tensor:
    """log π(response | prompt) of every row [2B]: the response tokens' log-probs summed (temperature 1).
    `packed`: the rows go through the model as one row without padding, a pair's prompt once where the model
    attends with `packed_attention` (`token_logps`)."""
    C = batch.response_mask.size(1)
    logps, _ = token_logps(model, batch.input_ids, batch.attention_mask, C, 1.0, packed=packed)  # [2B, C]
    return (logps * batch.response_mask).sum(-1)  # [2B]


# ----------------------------------------------------------------------------------------------------------------
# Training


def train_dpo(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    pairs: pd.DataFrame,
    cfg: DPOConfig,
    output_dir: str | Path,
    on_metrics: MetricsCallback | None = None,
    *,
    heldout: pd.DataFrame | None = None,
    source: str = "pairs",
    progress: bool = True,
    distributed: DistributedConfig | None = None,
) -> DPOResult:
    """Train `model` by DPO on `pairs` (prompt, chosen, rejected) against a frozen copy of itself; save it with its
    tokenizer to `output_dir/model`; resume from the newest checkpoint in `output_dir/checkpoints` if there is one.

    Held-out pairs are `heldout` when given, else `cfg.eval_fraction` of the prompts carved out of `pairs`.
    `distributed`: the stage's section; its strategy (ddp or fsdp) decides how the processes hold the policy.
    """
    output_dir = Path(output_dir)
    ckpt_root = output_dir / "checkpoints"
    if heldout is None and cfg.eval_fraction > 0:
        pairs, heldout = split_by_prompt(pairs, cfg.eval_fraction)
    if len(pairs) < cfg.batch_size:
        raise DataError(f"{source}: {len(pairs)} training pairs cannot fill a micro-batch of dpo.batch_size="
                        f"{cfg.batch_size}; give more pairs or lower the batch size")
    examples = tokenize_pairs(pairs, tokenizer, cfg.max_seq_len, source)  # both fail before any training
    held = tokenize_pairs(heldout, tokenizer, cfg.max_seq_len, f"{source} (held out)") \
        if heldout is not None and len(heldout) else []
    if cfg.lora is not None:
        require_peft()
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    acc = make_accelerator(cfg.mixed_precision, cfg.grad_accum_steps)
    strategy = make_strategy(acc, distributed)  # how the processes hold the policy
    check_split("dpo.batch_size", cfg.batch_size, acc.num_processes)  # pairs per global micro-batch
    model = model.to(acc.device)
    if cfg.lora is not None:  # only the adapters train; the reference is the base with them off
        model = add_lora(model, cfg.lora)
    # the reference: a frozen whole copy of the starting policy (forward only, on every process, as GRPO's), or
    # with LoRA none at all
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if cfg.lora is None else None
    optimizer = make_adamw(model, cfg.learning_rate, cfg.weight_decay)
    scheduler = make_scheduler(cfg.lr_scheduler, optimizer, num_warmup_steps=cfg.warmup_steps,
                               num_training_steps=cfg.max_steps)
    model, optimizer, scheduler = strategy.prepare(model, optimizer, scheduler)
    # each micro-batch's pairs as one row without padding (policy and reference alike), where it is exact
    packed = packing_on(cfg.packing, acc.unwrap_model(model))
    start = load_newest_checkpoint(acc, ckpt_root, strategy.load_state)  # 0: no checkpoint to trust, it starts over

    def reference_logps(batch: PairBatch) -> torch.Tensor:  # [2B], no gradient
        reference = ref_model if ref_model is not None else acc.unwrap_model(model)
        with torch.no_grad(), adapters_off(reference), acc.autocast():
            return sequence_logps(reference, batch, packed)

    def evaluate() -> dict[str, float]:
        """Held-out pair accuracy (margin > 0) and mean β·margin; every process scores all held-out pairs in the
        same batches (under fsdp each forward is a collective)."""
        if not held:
            return {"dpo/heldout_accuracy": math.nan, "dpo/heldout_margin": math.nan}
        model.eval()
        margins = []
        with torch.no_grad():
            for s in range(0, len(held), cfg.eval_batch_size):
                chunk = held[s : s + cfg.eval_batch_size]
                batch = _to(pair_batch(chunk, tokenizer.pad_token_id), acc.device)
                with acc.autocast():
                    h = sequence_logps(model, batch, packed) - reference_logps(batch)  # [2B]
                margins.append(h[: len(chunk)] - h[len(chunk) :])  # [B]
        model.train()
        m = torch.cat(margins)
        return {"dpo/heldout_accuracy": (m > 0).float().mean().item(),
                "dpo/heldout_margin": (cfg.beta * m).mean().item()}

    policy = causal_lm(acc.unwrap_model(model))  # the transformers model (inside LoRA's wrapper)
    window: dict[str, list[float]] = {}
    last_loss = math.nan
    start_time = time.perf_counter()
    bar = tqdm(total=cfg.max_steps, initial=start, desc="dpo", disable=not progress or not acc.is_main_process,
               mininterval=2.0)
    # faster attention on CPU and one tensor less per MLP kept for the backward; the same numbers; packed rows attend
    # sequence by sequence, held for the run (a recomputed layer finds it too)
    with (cpu_attention(policy, ref_model), compact_mlp(policy), attending_packed(policy, packed),
          attending_packed(ref_model, packed), activation_checkpointing(policy, cfg.gradient_checkpointing)):
        model.train()
        for step in range(start, cfg.max_steps):
            for micro in range(cfg.grad_accum_steps):
                idx = batch_indices(len(examples), cfg.batch_size, step * cfg.grad_accum_steps + micro, cfg.seed)
                mine = [examples[i] for i in process_share(acc, idx)]  # all of idx in one process
                B = len(mine)
                batch = _to(pair_batch(mine, tokenizer.pad_token_id), acc.device)
                ref = reference_logps(batch)  # [2B]
                with strategy.accumulate(model):
                    with acc.autocast():
                        logps = sequence_logps(model, batch, packed)  # [2B]
                    loss, stats = dpo_loss(logps[:B], logps[B:], ref[:B], ref[B:], beta=cfg.beta,
                                           loss_type=cfg.loss_type)
                    acc.backward(loss)  # every pair weighs the same: DDP's mean over processes is exact
                    grad_norm = optimizer_step(acc, model, optimizer, scheduler, cfg.max_grad_norm)
                for k, v in {"dpo/loss": loss.item(), **stats}.items():
                    window.setdefault(k, []).append(v)
            bar.update(1)
            done = step + 1
            if done % cfg.log_every == 0 or done == cfg.max_steps:
                means = reduce_metrics(acc, {k: sum(v) / len(v) for k, v in window.items()})  # over processes
                window.clear()
                last_loss = means["dpo/loss"]
                bar.set_postfix(loss=f"{last_loss:.3f}", acc=f"{means['dpo/accuracy']:.2f}")
                if on_metrics and acc.is_main_process:
                    on_metrics(done, {**means, "dpo/learning_rate": scheduler.get_last_lr()[0],
                                      "dpo/grad_norm": float(grad_norm) if grad_norm is not None else math.nan})
            if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < cfg.max_steps:
                save_checkpoint(acc, ckpt_root, done, cfg.keep_checkpoints, save_state=strategy.save_state)
        bar.close()
        seconds = time.perf_counter() - start_time
        heldout_metrics = evaluate()
    if on_metrics and held and acc.is_main_process:
        on_metrics(cfg.max_steps, heldout_metrics)

    model_dir = output_dir / "model"
    whole = strategy.whole_model(model)  # the whole weights, on the main process
    with main_only(acc) as main:
        if main:  # with LoRA: merged weights (what the next stage loads) and the adapter alone beside them
            save_merged(whole, model_dir, output_dir / "adapter")
            tokenizer.save_pretrained(model_dir)
            shutil.rmtree(ckpt_root, ignore_errors=True)  # the run finished: the final model supersedes them
    return DPOResult(model_dir, cfg.max_steps, last_loss, heldout_metrics, seconds)


def _to(batch: PairBatch, device: torch.device) -> PairBatch:
    return PairBatch(*(t.to(device) for t in batch))
