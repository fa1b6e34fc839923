"""A process reward model on the tiny task, the reference way: Math-Shepherd labels from a cold-start policy's rollouts.

usage: python benchmarks/prm_labels.py COLD_START_DIR [--recipe tiny] [--prompts 400] [--k 4] [--max-steps 150]
                                       [--out DIR]

1. the policy (COLD_START_DIR, e.g. the cold-start model benchmarks/process_supervision.py trains) answers
   `--prompts` training prompts of the recipe's reasoning_grpo data and 200 held-out ones, one sample each at the
   recipe's temperature;
2. every step of every answer (the arithmetic segmenter's equations) is labelled by `--k` rollouts from its prefix:
   good when one of them reaches the reference answer (Math-Shepherd's hard estimate);
3. a PRM is trained on the training labels in the reward model's way (the recipe's alignment_grpo.reward_model
   settings, `--max-steps`), from the policy's own backbone and, for comparison, from the embedded tiny one;
4. printed: label figures, and held-out AUC overall and among the steps of each position (a PRM that only learns
   where bad steps sit scores 0.5 there), against the rule verifier's verdicts as a score.
The trained PRM is saved under `--out` (use it with `process_supervision.py --step-verifier prm --prm DIR/model`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cold_start")
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--prompts", type=int, default=400)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-steps", type=int, default=150)
    ap.add_argument("--out", default="prm-out")
    args = ap.parse_args()

    from grpo.configs.model import ModelConfig
    from grpo.configs.recipe import load_recipe
    from grpo.data.tables import load_rl_data
    from grpo.models import load_model_and_tokenizer
    from grpo.rewards.steps import arithmetic_steps
    from grpo.sampling.local.backend import TransformersBackend
    from grpo.training.loops.prm import _auc, build_prm, encode_steps, label_steps, score_step_positions, train_prm

    recipe = load_recipe(args.recipe)
    rg = recipe.reasoning_grpo
    train, heldout = load_rl_data(rg.data)
    train = train.head(args.prompts)
    model, tok = load_model_and_tokenizer(ModelConfig(name_or_path=args.cold_start))
    backend = TransformersBackend(model, tok)
    t0 = time.perf_counter()
    labelled = {}
    for name, rows in (("train", train), ("heldout", heldout)):
        completions = backend.generate(rows["prompt"].tolist(), 1, rg.grpo.sampling).texts
        labelled[name] = label_steps(backend, rows.reset_index(drop=True), completions, args.k, rg.grpo.sampling,
                                     max_ungraded_share=rg.grpo.grading.max_ungraded_share)
        flat = [y for ys in labelled[name]["labels"] for y in ys]
        print(json.dumps({"labels": name, "completions": len(labelled[name]), "steps": len(flat),
                          "good_share": round(sum(flat) / len(flat), 3),
                          "seconds": round(time.perf_counter() - t0, 1)}), flush=True)

    held = labelled["heldout"]
    rule = [[r for r in s.rewards] for s in arithmetic_steps(held["completion"].tolist(), prompts=held["prompt"].tolist())]

    def report(name: str, scores: list[list[float]]) -> dict:
        out = {"scorer": name, "auc": round(_auc([x for r in scores for x in r],
                                                  [y for ys in held["labels"] for y in ys]), 3)}
        for j in range(max(len(ys) for ys in held["labels"])):
            pairs = [(r[j], ys[j]) for r, ys in zip(scores, held["labels"]) if len(ys) > j]
            auc = _auc([p for p, _ in pairs], [y for _, y in pairs])
            if auc == auc:  # NaN where the position has steps of one label only
                out[f"auc_step{j + 1}"] = round(auc, 3)
        return out

    print(json.dumps(report("rule (arithmetic verifier)", rule)), flush=True)
    cfg = recipe.alignment_grpo.reward_model
    for backbone, model_cfg in (("policy", ModelConfig(name_or_path=args.cold_start)),
                                ("tiny", cfg.model)):
        t = time.perf_counter()
        result = train_prm(labelled["train"], cfg.model_copy(update={"model": model_cfg, "max_steps": args.max_steps}),
                           Path(args.out) / backbone, heldout=held)
        prm, prm_tok = build_prm(ModelConfig(name_or_path=str(result.model_dir)))
        scores = score_step_positions(prm.eval(), prm_tok.pad_token_id,
                                      encode_steps(prm_tok, held["prompt"], held["completion"], held["step_ends"]))
        print(json.dumps({**report(f"PRM from the {backbone} backbone", scores), "model": str(result.model_dir),
                          "train_seconds": round(time.perf_counter() - t, 1)}), flush=True)


if __name__ == "__main__":
    main()
