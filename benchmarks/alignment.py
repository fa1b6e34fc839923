"""Does the alignment stage align? Its measures before -> after on the same prompts, per seed and pooled.

usage: python benchmarks/alignment.py [--sft CHECKPOINT] [--seeds 0 1 2] [--recipe tiny] [--ablation one]
                                      [--steps N] [--out DIR]

From one SFT checkpoint (`--sft`; by default one is trained here as the recipe's SFT stage would train it: the
cold-start rows plus the recipe's share of general rows, `non_reasoning_rows`, from the base model), each seed runs
the recipe's alignment stage as `flows/alignment_grpo.py` does, through the same functions without Prefect or MLflow:
the reward models its rewards name, trained on the preference pairs (from the SFT checkpoint with
`reward_model.from_policy`), GRPO on the stage's prompt mix, then greedy evaluation. Per seed and pooled over seeds it
prints each measure (`grpo.evaluate.ALIGNMENT_MEASURES`: harmful refused, benign helpful, borderline refused and
helpful, handled right) before -> after with its paired 95% interval over distinct requests (grpo.stats: Agresti-Min
with the variance summed by request, an exact sign-flip p; a request's lead-in copies count once),
on the held-out phrasings (`alignment/`), apart on the held-out subjects (`alignment_subjects/`), and on training
subjects and phrasings the stage did not draw (`alignment_train/`: in distribution); reasoning accuracy on the held-out problems likewise;
the reward models' held-out pair accuracy per flaw; and the stage's time. Pooled means the seeds' prompts side by side
(n x seeds verdicts each before and after: the before side repeats, since every seed starts from the same
checkpoint), with a request's verdicts of every seed counted as one request (a held-out problem's likewise).
`--ablation one` trains one reward model for every general prompt instead of the recipe's two, on the same seeds;
`--ablation oracle` rewards general rows with the generator's true verdict (what a perfect reward model
would give): where even that does not move the held-out phrasings, the limit is the policy's generalisation, not its
reward models. The last line is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def cpu_line() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        name = fields.get("Model name", "?").strip()
        family, model = fields.get("CPU family", "?").strip(), fields.get("Model", "?").strip()
        flags = fields.get("Flags", "")
    except OSError:
        name, family, model, flags = platform.processor(), "?", "?", ""
    bf16 = "avx512_bf16" in flags or "amx_bf16" in flags
    return f"{name} (family {family} model {model}), {os.cpu_count()} cores, bf16 {'native' if bf16 else 'emulated'}"


def train_sft(recipe, out: Path) -> str:
    """The SFT checkpoint the alignment stage starts from: the base model on the cold-start rows plus the recipe's
    general rows (the share `rejection_sampling.rejection.non_reasoning_rows` gives the stage-4 SFT)."""
    import pandas as pd

    from grpo.data.general import general_sft_rows
    from grpo.data.tables import load_sft_data
    from grpo.models import load_model_and_tokenizer
    from grpo.training.loops.sft_trainer import train_sft as sft

    cold, _ = load_sft_data(recipe.cold_start_sft.data)
    general = general_sft_rows(recipe.rejection_sampling.rejection.non_reasoning_rows, recipe.rejection_sampling.rejection.seed)
    rows = pd.concat([cold[["prompt", "response"]], general], ignore_index=True)
    model, tok = load_model_and_tokenizer(recipe.sft.model)
    cfg = recipe.sft.train.model_copy(update={"checkpoint_every": 0})
    print(f"training the SFT start: {len(cold)} cold-start + {len(general)} general rows, {cfg.max_steps} steps",
          flush=True)
    return str(sft(model, tok, rows, cfg, out / "sft", progress=True).model_dir)


def in_distribution(stage, per_category: int):
    """Training subjects under training phrasings, none of them a prompt the stage trains on: what GRPO can learn
    directly, beside the held-out phrasings it has to generalise to."""
    import pandas as pd

    from grpo.data.general import CATEGORIES, general_prompts

    trained = set(general_prompts(stage.general_prompts, seed=stage.data.task.seed)["prompt"])
    rest = general_prompts(0, split="train")
    rest = rest[~rest["prompt"].isin(trained)]
    return pd.concat([rest[rest["category"] == c].sample(min(per_category, (rest["category"] == c).sum()),
                                                         random_state=0) for c in CATEGORIES], ignore_index=True)


def measure(path: str, stage, sets: dict, heldout) -> dict:
    """Greedy verdicts of the checkpoint at `path`: each alignment set's table and the held-out reasoning ones."""
    from grpo.evaluate import evaluate, evaluate_alignment
    from grpo.models import load_model_and_tokenizer
    from grpo.sampling.engines import build_engine

    model, tok = load_model_and_tokenizer(stage.model.model_copy(update={"name_or_path": path}))
    engine = build_engine(stage.generation, model, tok, who="alignment benchmark")
    eval_cfg = stage.eval.model_copy(update={"max_new_tokens": stage.alignment_eval.max_new_tokens
                                             or stage.eval.max_new_tokens})
    out = {prefix: evaluate_alignment(engine, prompts, eval_cfg, prefix).samples for prefix, prompts in sets.items()}
    out["reasoning"] = evaluate(engine, heldout, stage.eval).verdicts
    return out


def true_reward(completions, prompts=None, kind=None, category=None, reference=None, **_):
    """The generator's own verdict as the reward of general rows (`--ablation oracle`): what a perfect reward model
    would give, so the stage's limit can be told from its reward models' (None on reasoning rows)."""
    from grpo.data.general import handled_right

    return [None if k != "general" else float(handled_right(c, cat, ref if isinstance(ref, str) else None, str(p)))
            for c, p, k, cat, ref in zip(completions, prompts, kind, category, reference)]


def run_seed(stage, sft: str, seed: int, out: Path, sets: dict, heldout, before: dict) -> dict:
    """The stage from `sft` with `seed`: its reward models, GRPO, and the paired changes against `before`."""
    from grpo.configs.reward import REWARD_MODELS
    from grpo.data.preferences import alignment_prompts, load_preference_data, pairs_for
    from grpo.data.general import general_prompts
    from grpo.data.tables import load_rl_data
    from grpo.evaluate import paired_alignment
    from grpo.models import load_model_and_tokenizer
    from grpo.rewards import REWARD_FUNCTIONS
    from grpo.stats import paired_change
    from grpo.training.alignment_watch import AlignmentWatch
    from grpo.training.loops.grpo_trainer import GRPOTrainer
    from grpo.training.loops.reward_model import train_reward_model
    from grpo.training.reward_scorer import ROUTES, RewardModelScorer, reward_model_reward

    t0 = time.perf_counter()
    grpo = stage.grpo.model_copy(update={"seed": seed})
    names = [n for n in REWARD_MODELS if n in grpo.rewards] + (["truth"] if "truth" in grpo.rewards else [])
    pairs, pairs_heldout = load_preference_data(stage.preferences.model_copy(update={"seed": seed}))
    rm_cfg = stage.reward_model.model_copy(update={"seed": seed})
    if rm_cfg.from_policy:
        rm_cfg = rm_cfg.model_copy(update={"model": stage.model.model_copy(update={"name_or_path": sft})})
    functions, rm_figures = dict(REWARD_FUNCTIONS), {}
    answer_only = rm_cfg.helpfulness_reads == "answer"  # as the stage reads it (tasks/alignment.py, jobs.py)
    functions["truth"] = true_reward
    for name in (n for n in names if n != "truth"):
        steps = stage.reward_model_for(name).max_steps  # the recipe's reward_model_steps, as the stage reads them
        result = train_reward_model(pairs_for(pairs, name, answer_only=answer_only),
                                    rm_cfg.model_copy(update={"max_steps": steps}),
                                    out / f"seed{seed}" / name, progress=False,
                                    heldout=None if pairs_heldout is None else pairs_for(pairs_heldout, name,
                                                                                         answer_only=answer_only))
        rm_figures[name] = {k.split("/", 1)[1]: round(v, 3) for k, v in result.heldout_metrics.items()}
        route = ROUTES[name]._replace(answer_only=answer_only) if name == "helpfulness" else ROUTES[name]
        functions[name] = reward_model_reward(RewardModelScorer.from_pretrained(result.model_dir), route=route)
    t_rm = time.perf_counter() - t0
    reasoning, _ = load_rl_data(stage.data)
    rows = alignment_prompts(reasoning, general_prompts(stage.general_prompts, seed=stage.data.task.seed))
    watch = AlignmentWatch(rows, names, grpo.num_generations, stage.watch.every, stage.watch.windows)
    log: list[tuple[int, dict]] = []
    model, tok = load_model_and_tokenizer(stage.model.model_copy(update={"name_or_path": sft}))
    trainer = GRPOTrainer(model, tok, rows, grpo, out / f"seed{seed}" / "grpo", reward_functions=functions,
                          generation=stage.generation, hooks=[watch], progress=False,
                          on_metrics=lambda step, m: log.append((step, m)))
    trained = str(trainer.train().model_dir)
    t_grpo = time.perf_counter() - t0 - t_rm
    after = measure(trained, stage, sets, heldout)
    changes = {}
    for prefix in sets:
        changes.update({k: v for k, v in paired_alignment(before[prefix], after[prefix], prefix).items()})
    changes["reasoning/accuracy"] = paired_change([v == 1.0 for v in before["reasoning"]],
                                                  [v == 1.0 for v in after["reasoning"]])
    windows = [(s, m["watch/true_score"], m["watch/rm_score"]) for s, m in log if "watch/true_score" in m]
    return {"seed": seed, "after": after, "changes": changes, "reward_models": rm_figures, "watch": windows,
            "mixed_groups": [round(m.get("general/mixed_groups", float("nan")), 3) for _, m in log],
            "seconds": {"reward_models": round(t_rm), "grpo": round(t_grpo), "all": round(time.perf_counter() - t0)}}


def pooled(before: dict, runs: list[dict], sets: dict) -> dict:
    """Each measure over every seed's prompts side by side."""
    import pandas as pd

    from grpo.evaluate import paired_alignment
    from grpo.stats import paired_change

    out = {}
    for prefix in sets:
        b = pd.concat([before[prefix]] * len(runs), ignore_index=True)
        a = pd.concat([r["after"][prefix] for r in runs], ignore_index=True)
        out.update(paired_alignment(b, a, prefix))
    out["reasoning/accuracy"] = paired_change([v == 1.0 for _ in runs for v in before["reasoning"]],
                                              [v == 1.0 for r in runs for v in r["after"]["reasoning"]],
                                              [i for _ in runs for i in range(len(before["reasoning"]))])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft", help="the SFT checkpoint folder to start from (default: train one here)")
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--ablation", choices=["one", "oracle"], nargs="+", default=[],
                    help="also run one reward model for every general prompt (one), or the generator's true verdict "
                         "in place of the reward models (oracle: the most reward modelling could give)")
    ap.add_argument("--steps", type=int, help="GRPO steps (default: the recipe's)")
    ap.add_argument("--out", help="a folder for the checkpoints (default: a temporary one)")
    args = ap.parse_args()

    import torch

    from grpo.configs.recipe import load_recipe
    from grpo.data.general import alignment_eval_sets
    from grpo.data.tables import load_rl_data

    torch.manual_seed(0)
    recipe = load_recipe(args.recipe)
    stage = recipe.alignment_grpo
    if args.steps:
        stage = stage.model_copy(update={"grpo": stage.grpo.model_copy(update={"max_steps": args.steps})})
    out = Path(args.out or tempfile.mkdtemp(prefix="alignment-bench-"))
    print(f"CPU: {cpu_line()}; torch {torch.__version__}, {torch.get_num_threads()} threads; load "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    t0 = time.perf_counter()
    sft = args.sft or train_sft(recipe, out)
    t_sft = time.perf_counter() - t0
    sets = alignment_eval_sets(stage.alignment_eval)
    sets["alignment_train"] = in_distribution(stage, stage.alignment_eval.per_category)
    _, heldout = load_rl_data(stage.data)
    before = measure(sft, stage, sets, heldout)
    variants = {"recipe": stage}
    rules = {k: v for k, v in stage.grpo.rewards.items() if k not in ("helpfulness", "harmlessness", "reward_model")}
    for ablation, name in (("one", "reward_model"), ("oracle", "truth")):
        if ablation in args.ablation:
            label = "one reward model" if ablation == "one" else "oracle (the true verdict as reward)"
            variants[label] = stage.model_copy(update={"grpo": stage.grpo.model_copy(
                update={"rewards": {**rules, name: 1.0}})})
    summary = {"cpu": cpu_line(), "sft_s": round(t_sft), "variants": {}}
    for label, variant in variants.items():
        runs = []
        for seed in args.seeds:
            r = run_seed(variant, sft, seed, out / label.replace(" ", "_"), sets, heldout, before)
            runs.append(r)
            print(f"\n[{label}] seed {seed}: {r['seconds']['all']} s (reward models {r['seconds']['reward_models']} s, "
                  f"GRPO {r['seconds']['grpo']} s); reward models' held-out accuracy {r['reward_models']}")
            print(f"  watch (step, true score, reward models' score): {r['watch']}")
            for key, change in r["changes"].items():
                print(f"  {key:<38} {change.describe()}")
        print(f"\n[{label}] pooled over seeds {args.seeds}:")
        both = pooled(before, runs, sets)
        for key, change in both.items():
            print(f"  {key:<38} {change.describe()}")
        summary["variants"][label] = {
            "pooled": {k: [round(c.before, 3), round(c.after, 3), round(c.low, 3), round(c.high, 3)]
                       for k, c in both.items()},
            "per_seed": {r["seed"]: {k: [round(c.change, 3), round(c.low, 3), round(c.high, 3)]
                                     for k, c in r["changes"].items()} for r in runs},
            "stage_s": [r["seconds"]["all"] for r in runs]}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
