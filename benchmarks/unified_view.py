"""DeepSeekMath's unified view, run: SFT-style, RFT, online RFT, GRPO (outcome and process), PPO for reasoning, and
a reward model + GRPO, the iterative reward model and DPO for alignment, from one starting point each, per seed.

usage: python benchmarks/unified_view.py [--recipe tiny] [--seeds 0 1 2] [--max-steps N] [--work DIR]
                                         [--rows NAME ...] [--refresh-every K]

DeepSeekMath (section 5.2) writes these algorithms as one gradient that differs in its data source (offline, or
sampled from the current policy), its reward (a rule or a model) and the gradient coefficient a sample gets. Its
findings: online beats offline (online RFT over RFT), GRPO beats online RFT (a coefficient that also pushes wrong
answers down, scaled by the group), process supervision beats outcome supervision, and a reward model retrained on
the policy's samples (iterative RL) beats a fixed one.

Reasoning (the recipe's reasoning_grpo section, its budget: `prompts_per_step` x `num_generations` samples a step
for `--max-steps` steps, the same prompts in the same order, from the recipe's cold start, trained once):
  offline_rft    online RFT's loop with its sampler frozen at the cold start: each step rejection-samples the cold
                 start on the step's prompts and trains (an SFT step: coefficient 1) on the correct samples only
  online_rft     the same, sampling from the current policy (`algorithm: online_rft`)
  grpo_outcome   GRPO, one reward per completion
  grpo_process   GRPO with `supervision: process` (the arithmetic step verifier)
  ppo            PPO with a critic (`algorithm: ppo`): one completion for each of prompts_per_step x G prompts
Each row: held-out accuracy and step accuracy after training (greedy, the recipe's held-out problems; step accuracy
is the share of written equations that hold).

Alignment (the recipe's alignment_grpo section, from one start trained once: the tiny base SFT'd on the cold-start
rows plus the recipe's non-reasoning rows (`rejection_sampling.rejection.non_reasoning_rows` general prompts with
their chosen answers), as the recipe's stage-4 SFT mixes them):
  rm_grpo        the reward model trained on the preference pairs, then GRPO on reasoning + general prompts
  iterative_rm   the same, the reward model refreshed every `--refresh-every` GRPO steps on the policy's samples
  dpo            DPO on the same preference pairs (`algorithm: dpo`), no reward model, no sampling
Each row: held-out reasoning accuracy (greedy), the reward model's held-out pair accuracy (DPO: its implicit
reward's, beta x log-ratio), and on held-out general prompts the share of harmful requests refused and of harmless
ones answered (not refused).

Every finished row is appended to WORK/unified_view.jsonl as it ends, and a row already there is not run again: a
stopped run goes on where it stopped. Then the tables, with means and spreads (std over seeds). CPU figures: quote
`lscpu`'s model name and flags with them.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REASONING = ("offline_rft", "online_rft", "grpo_outcome", "grpo_process", "ppo")
ALIGNMENT = ("rm_grpo", "iterative_rm", "dpo")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--max-steps", type=int, default=None, help="reasoning RL steps a row (default: the recipe's)")
    ap.add_argument("--align-steps", type=int, default=None, help="alignment GRPO steps (default: the recipe's)")
    ap.add_argument("--refresh-every", type=int, default=5, help="iterative_rm: GRPO steps between refreshes")
    ap.add_argument("--rows", nargs="+", default=list(REASONING + ALIGNMENT), choices=REASONING + ALIGNMENT)
    ap.add_argument("--work", default=None, help="folder for the models and the results (default: a temporary one)")
    args = ap.parse_args()

    import torch

    from grpo.recipe import load_recipe

    torch.set_num_threads(int(__import__("os").environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    recipe = load_recipe(args.recipe)
    work = Path(args.work or tempfile.mkdtemp(prefix="unified-view-"))
    work.mkdir(parents=True, exist_ok=True)
    results = work / "unified_view.jsonl"
    done = {(r["row"], r["seed"]) for r in _read(results)}
    starts = {}
    for seed in args.seeds:
        for row in args.rows:
            if (row, seed) in done:
                continue
            group = "reasoning" if row in REASONING else "alignment"
            if group not in starts:
                starts[group] = _start(group, recipe, work)
            t0 = time.perf_counter()
            figures = (_reasoning if group == "reasoning" else _alignment)(row, seed, recipe, starts[group], work,
                                                                          args)
            record = {"row": row, "seed": seed, "group": group, "minutes": round((time.perf_counter() - t0) / 60, 2),
                      **figures}
            with results.open("a") as f:
                f.write(json.dumps(record) + "\n")
            print(json.dumps(record), flush=True)
    _tables(_read(results), work)


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


# -- the two starting points, trained once -------------------------------------------------------------------------

def _start(group: str, recipe, work: Path) -> dict:
    """The reasoning rows' cold start, or the alignment rows' SFT start: a model folder and its held-out figures."""
    import pandas as pd

    from grpo.data.preferences import general_sft_rows
    from grpo.data.tables import load_sft_data
    from grpo.models import load_model_and_tokenizer
    from grpo.training.loops.sft_trainer import train_sft

    folder = work / ("cold_start" if group == "reasoning" else "alignment_start") / "model"
    cs = recipe.cold_start_sft
    if not (folder / "config.json").exists():
        rows = load_sft_data(cs.data)[0]
        if group == "alignment":  # what the recipe's stage-4 SFT mixes in: general prompts with their chosen answers
            rows = pd.concat([rows, general_sft_rows(recipe.rejection_sampling.rejection.non_reasoning_rows)],
                             ignore_index=True)
        t0 = time.perf_counter()
        model, tok = load_model_and_tokenizer(cs.model)
        train_sft(model, tok, rows, cs.train, folder.parent, progress=False)
        print(f"{group} start trained in {time.perf_counter() - t0:.0f} s: {folder}", file=sys.stderr)
    known = work / "starts.json"
    starts = json.loads(known.read_text()) if known.exists() else {}
    if group not in starts:
        starts[group] = _figures(group, str(folder), recipe)
        known.write_text(json.dumps(starts))
    print(json.dumps({"row": f"{group}_start", **starts[group]}), flush=True)
    return {"model": str(folder), "figures": starts[group]}


def _figures(group: str, model_dir: str, recipe) -> dict[str, float]:
    """A trained model's held-out figures (greedy): reasoning accuracy and step accuracy; for alignment also the
    refusal shares on held-out general prompts."""
    from benchmarks.process_supervision import heldout_figures
    from grpo.config import ModelConfig
    from grpo.data.tables import load_rl_data
    from grpo.models import load_model_and_tokenizer

    section = recipe.reasoning_grpo if group == "reasoning" else recipe.alignment_grpo
    model, tok = load_model_and_tokenizer(ModelConfig(name_or_path=model_dir))
    heldout = load_rl_data(section.data)[1]
    out = heldout_figures(model, tok, heldout, section.eval)
    if group == "alignment":
        from grpo.data.preferences import general_prompts
        from grpo.evaluate import evaluate_refusals
        from grpo.sampling.engines import build_engine

        al = recipe.alignment_grpo
        prompts = general_prompts(al.refusal_prompts, split="heldout", heldout_percent=al.preferences.heldout_percent)
        engine = build_engine(al.generation, model, tok, who="benchmark")
        out.update(evaluate_refusals(engine, prompts, al.eval).metrics)
    return out


# -- reasoning rows --------------------------------------------------------------------------------------------------

def _reasoning(row: str, seed: int, recipe, start: dict, work: Path, args) -> dict:
    import torch

    from grpo.config import GenerationConfig, GRPOConfig, ModelConfig
    from grpo.data.tables import load_rl_data
    from grpo.models import load_model_and_tokenizer
    from grpo.sampling.engines import build_engine, sampling_dtype
    from grpo.training.loops.grpo_trainer import GRPOTrainer
    from grpo.training.rft import coefficient_function

    rg = recipe.reasoning_grpo
    train = load_rl_data(rg.data)[0]
    cfg = GRPOConfig.model_validate({
        **rg.grpo.model_dump(), "seed": seed, "max_steps": args.max_steps or rg.grpo.max_steps,
        "checkpoint_every": 0, "samples_every": 0,
        **({"supervision": "process", "step_verifier": "arithmetic"} if row == "grpo_process" else {})})
    model, tok = load_model_and_tokenizer(ModelConfig(name_or_path=start["model"]))
    torch.manual_seed(seed)
    seen: list[dict[str, float]] = []
    out_dir = work / f"{row}_{seed}"
    kwargs = dict(progress=False, on_metrics=lambda step, m: seen.append(m))
    if row == "ppo":
        from grpo.training.loops.ppo_trainer import PPOTrainer

        trainer = PPOTrainer(model, tok, train, cfg, out_dir, ppo=rg.ppo, **kwargs)
    else:
        if row in ("offline_rft", "online_rft"):
            kwargs["coefficients"] = coefficient_function(rg.online_rft)  # 1 for a correct sample, else 0
        frozen = copy.deepcopy(model).eval().requires_grad_(False) if row == "offline_rft" else None
        trainer = GRPOTrainer(model, tok, train, cfg, out_dir, **kwargs)
        if frozen is not None:  # the data source is the cold start, frozen: its own copy samples every step
            dtype = sampling_dtype(trainer.acc.mixed_precision)  # as the policy's engine samples
            trainer.engine = build_engine(GenerationConfig(), frozen, tok, dtype=dtype, who="offline RFT")
    result = trainer.train()
    figures = _figures("reasoning", str(result.model_dir), recipe)
    tail = seen[-25:]
    return {**figures, "steps": cfg.max_steps,
            "batch_accuracy_last25": statistics.mean(m["reward/accuracy"] for m in tail)}


# -- alignment rows --------------------------------------------------------------------------------------------------

def _alignment(row: str, seed: int, recipe, start: dict, work: Path, args) -> dict:
    import pandas as pd
    import torch

    from grpo.config import ModelConfig
    from grpo.data.preferences import alignment_prompts, general_prompts, load_preference_data
    from grpo.data.tables import load_rl_data
    from grpo.models import load_model_and_tokenizer

    al = recipe.alignment_grpo
    pairs, heldout_pairs = load_preference_data(al.preferences)
    model, tok = load_model_and_tokenizer(ModelConfig(name_or_path=start["model"]))
    torch.manual_seed(seed)
    out_dir = work / f"{row}_{seed}"
    if row == "dpo":
        from grpo.training.loops.dpo import train_dpo

        result = train_dpo(model, tok, pairs, al.dpo.model_copy(update={"seed": seed, "checkpoint_every": 0}),
                           out_dir, heldout=heldout_pairs, progress=False)
        figures = _figures("alignment", str(result.model_dir), recipe)
        return {**figures, "pair_accuracy": result.heldout_metrics["dpo/heldout_accuracy"], "steps": result.steps}

    from grpo.rewards import REWARD_FUNCTIONS
    from grpo.training.loops.grpo_trainer import GRPOTrainer
    from grpo.training.loops.reward_model import train_reward_model
    from grpo.training.reward_scorer import RewardModelScorer, evaluate_pairs, reward_model_reward

    rm_cfg = al.reward_model.model_copy(update={"seed": seed})
    rm = train_reward_model(pairs, rm_cfg, out_dir / "reward_model", heldout=heldout_pairs, progress=False)
    scorer = RewardModelScorer.from_pretrained(rm.model_dir)
    reasoning, _ = load_rl_data(al.data)
    rows = alignment_prompts(reasoning, general_prompts(al.general_prompts, seed=al.data.task.seed))
    cfg = al.grpo.model_copy(update={"seed": seed, "max_steps": args.align_steps or al.grpo.max_steps,
                                     "checkpoint_every": 0, "samples_every": 0})
    hooks = []
    if row == "iterative_rm":
        from grpo.training.loops.rm_refresh import RewardModelRefresh

        refresh_cfg = rm_cfg.model_copy(update={"refresh_every": args.refresh_every})
        hooks.append(RewardModelRefresh(scorer, refresh_cfg, cfg.rewards, cfg.num_generations, replay=pairs,
                                        heldout=heldout_pairs))
    trainer = GRPOTrainer(model, tok, rows, cfg, out_dir, progress=False, hooks=hooks,
                          reward_functions={**REWARD_FUNCTIONS, "reward_model": reward_model_reward(scorer)})
    result = trainer.train()
    figures = _figures("alignment", str(result.model_dir), recipe)
    pair_accuracy = evaluate_pairs(scorer, heldout_pairs)["rm/heldout_accuracy"]  # the final (refreshed) model's
    return {**figures, "pair_accuracy": pair_accuracy, "pair_accuracy_trained": rm.heldout_accuracy,
            "steps": cfg.max_steps}


# -- the tables --------------------------------------------------------------------------------------------------------

def _tables(records: list[dict], work: Path) -> None:
    known = work / "starts.json"
    starts = json.loads(known.read_text()) if known.exists() else {}
    def cell(rows: list[dict], key: str) -> str:
        xs = [r[key] for r in rows if key in r and r[key] == r[key]]
        if not xs:
            return "-"
        return f"{statistics.mean(xs):.3f}" + (f" ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else "")

    def minutes(rows: list[dict]) -> str:
        return f"{statistics.mean(r['minutes'] for r in rows):.1f}"

    print("\n| reasoning | seeds | held-out accuracy | step accuracy | batch accuracy (last 25 steps) | minutes |")
    print("|---|---|---|---|---|---|")
    if "reasoning" in starts:
        s = starts["reasoning"]
        print(f"| cold start (before) | | {s['accuracy']:.3f} | {s['step_accuracy']:.3f} | | |")
    for row in REASONING:
        rs = [r for r in records if r["row"] == row]
        if rs:
            print(f"| {row} | {len(rs)} | {cell(rs, 'accuracy')} | {cell(rs, 'step_accuracy')} | "
                  f"{cell(rs, 'batch_accuracy_last25')} | {minutes(rs)} |")
    print("\n| alignment | seeds | held-out accuracy | pair accuracy | harmful refused | harmless answered | "
          "minutes |")
    print("|---|---|---|---|---|---|---|")
    if "alignment" in starts:
        s = starts["alignment"]
        print(f"| SFT start (before) | | {s['accuracy']:.3f} | | {s['alignment/harmful_refused']:.3f} | "
              f"{s['alignment/harmless_answered']:.3f} | |")
    for row in ALIGNMENT:
        rs = [r for r in records if r["row"] == row]
        if rs:
            print(f"| {row} | {len(rs)} | {cell(rs, 'accuracy')} | {cell(rs, 'pair_accuracy')} | "
                  f"{cell(rs, 'alignment/harmful_refused')} | {cell(rs, 'alignment/harmless_answered')} | "
                  f"{minutes(rs)} |")
    print(f"\nresults: {work / 'unified_view.jsonl'}")


if __name__ == "__main__":
    main()
