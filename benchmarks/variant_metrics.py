"""Every figure of every step of each RL loop variant, on the tests' tiny model: the record a change to the loop's
structure must leave the same, byte for byte.

usage: python benchmarks/variant_metrics.py [--out PATH] [--only NAME ...]
       python benchmarks/variant_metrics.py --compare A.json B.json

Runs 3 steps of each variant (plain GRPO with mu = 2 and a KL term, asynchronous rollouts at max_staleness 0, dynamic
sampling, online RFT's coefficients, offline RFT's frozen sampler, process supervision, PPO) on the tiny model of
`tests/helpers/tiny_configs.py`, fp32, MKL GEMMs, one thread, the same seeds, and prints (or writes to `--out`) a
JSON object: variant -> step -> {metric: float}, each float written with `repr` so that equal JSON is equal bits;
beside the steps, `weights_sha256` is the digest of the trained policy's parameters. `--compare` lists every
metric whose value differs between two records, leaving out the figures that are clocks (`TIMING`), and exits 1
if any does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "helpers"))

STEPS = 3


def is_timing(key: str) -> bool:
    """A figure read off a clock, which no two runs share: step and part times, throughput, waits."""
    return key.endswith("_s") or key.startswith("time/") or key == "tokens_per_s" or key.endswith("/tokens_per_s")


TIMING = "keys ending in _s, under time/, tokens_per_s"


def digits(completions, **_):
    """A completion's reward is the digits it holds: a random model writes some, unevenly."""
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def odd_digits(completions, answer, **_):
    """Digits for the prompts whose answer is odd, 0.0 for the others: their groups agree, so dynamic sampling drops
    and refills them."""
    return [float(sum(ch.isdigit() for ch in c)) if int(a) % 2 else 0.0 for c, a in zip(completions, answer)]


def every_third(completions, **_):
    """'Correct' for completions 0, 3, 6, ... of a step: a fixed mix of right and wrong, whatever is sampled."""
    return [1.0 if i % 3 == 0 else 0.0 for i in range(len(completions))]


def thirds(completions, **_):
    """A step verifier that reads any text: steps end at a third and two thirds of it, each holding when its part has
    a digit (the tiny random model writes no equation for the arithmetic verifier to find)."""
    from grpo.rewards.steps import Steps

    out = []
    for text in completions:
        ends = sorted({e for e in (len(text) // 3, 2 * len(text) // 3) if e > 0})
        starts = [0] + ends[:-1]
        out.append(Steps(tuple(ends), tuple(float(any(ch.isdigit() for ch in text[s:e]))
                                            for s, e in zip(starts, ends))))
    return out


def variants():
    """name -> (GRPOConfig overrides, trainer keyword arguments, which loop)."""
    from grpo.configs.ppo import PPOConfig
    from grpo.configs.rft import OnlineRFTConfig
    from grpo.configs.rollout import RolloutConfig
    from grpo.rewards import REWARD_FUNCTIONS
    from grpo.training.rft import coefficient_function

    rft = {"reward_functions": {**REWARD_FUNCTIONS, "accuracy": every_third},
           "coefficients": coefficient_function(OnlineRFTConfig())}
    return {
        "grpo": ({"num_iterations": 2}, {}, "grpo"),
        "async_k0": ({"tis_cap": 2.0, "rollout": RolloutConfig(mode="async", max_staleness=0, threads=1)}, {}, "grpo"),
        "dynamic": ({"dynamic_sampling": True, "max_refill_rounds": 2, "rewards": {"odd_digits": 1.0}},
                    {"reward_functions": {"odd_digits": odd_digits}}, "grpo"),
        "rft": ({"rewards": {"accuracy": 1.0, "format": 0.5}}, rft, "grpo"),
        "rft_offline": ({"rewards": {"accuracy": 1.0, "format": 0.5}}, {**rft, "engine": "frozen"}, "grpo"),
        "process": ({"supervision": "process", "step_verifier": "arithmetic"},
                    {"reward_functions": {**REWARD_FUNCTIONS, "digits": digits},
                     "step_verifiers": {"arithmetic": thirds}}, "grpo"),
        "ppo": ({"learning_rate": 1e-3}, {"ppo": PPOConfig()}, "ppo"),
    }


def run_variant(name: str, folder: Path) -> dict:
    import torch

    from grpo.configs.sampling import GenerationConfig, SamplingConfig
    from grpo.configs.training import GRPOConfig
    from grpo.models import load_model_and_tokenizer
    from grpo.sampling.engines import build_engine
    from grpo.training.loops.grpo_trainer import GRPOTrainer
    from grpo.training.loops.ppo_trainer import PPOTrainer
    from tiny_configs import SMALL

    import pandas as pd

    overrides, kwargs, loop = variants()[name]
    prompts = pd.DataFrame({"prompt": [f"Say {i}" for i in range(8)], "answer": [str(i) for i in range(8)]})
    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(SMALL)
    cfg = GRPOConfig(**{"max_steps": STEPS, "prompts_per_step": 2, "num_generations": 4, "checkpoint_every": 0,
                        "log_every": 1, "sampling": SamplingConfig(max_new_tokens=12, temperature=0.9, top_p=0.9),
                        "rewards": {"digits": 1.0}, "learning_rate": 1e-2, "beta": 0.04, "mixed_precision": "no",
                        "fp32_gemm": "mkl", **overrides})
    kwargs = {"reward_functions": {"digits": digits}, **kwargs}
    if kwargs.get("engine") == "frozen":  # offline RFT: a frozen copy of the start samples every step
        import copy

        kwargs["engine"] = build_engine(GenerationConfig(), copy.deepcopy(model).eval().requires_grad_(False), tok,
                                        dtype=torch.float32, who="offline RFT")
    seen: dict[int, dict[str, float]] = {}
    trainer = (PPOTrainer if loop == "ppo" else GRPOTrainer)(
        model, tok, prompts, cfg, folder, progress=False, on_metrics=lambda step, m: seen.__setitem__(step, dict(m)),
        **kwargs)
    trainer.train()
    digest = hashlib.sha256()
    for n, p in sorted(trainer.acc.unwrap_model(trainer.model).named_parameters()):
        digest.update(n.encode())
        digest.update(p.detach().float().cpu().numpy().tobytes())
    return {"steps": {str(s): {k: repr(float(v)) for k, v in sorted(m.items())} for s, m in sorted(seen.items())},
            "weights_sha256": digest.hexdigest()}


def record(names: list[str]) -> dict:
    import torch

    torch.set_num_threads(1)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            out[name] = run_variant(name, Path(tmp) / name)
            print(f"{name}: {len(out[name]['steps'])} steps", file=sys.stderr)
    return out


def compare(a: dict, b: dict) -> list[str]:
    """Every difference between two records, timing figures left out."""
    diffs = []
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            diffs.append(f"{name}: only in {'B' if name not in a else 'A'}")
            continue
        if a[name]["weights_sha256"] != b[name]["weights_sha256"]:
            diffs.append(f"{name}: trained weights differ")
        sa, sb = a[name]["steps"], b[name]["steps"]
        for step in sorted(set(sa) | set(sb), key=int):
            ma, mb = sa.get(step, {}), sb.get(step, {})
            for key in sorted(set(ma) | set(mb)):
                if is_timing(key):
                    continue
                va, vb = ma.get(key), mb.get(key)
                same = va == vb or (va is not None and vb is not None and math.isnan(float(va))
                                    and math.isnan(float(vb)))
                if not same:
                    diffs.append(f"{name} step {step} {key}: {va} != {vb}")
    return diffs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"))
    args = parser.parse_args()
    if args.compare:
        a, b = (json.loads(p.read_text()) for p in args.compare)
        diffs = compare(a, b)
        timing = sorted({k for rec in (a, b) for v in rec.values() for m in v["steps"].values() for k in m
                         if is_timing(k)})
        print(f"left out as timing ({TIMING}): {', '.join(timing)}")
        print("\n".join(diffs) if diffs else f"same: {', '.join(sorted(a))}, every step's figures and weights")
        sys.exit(1 if diffs else 0)
    result = record(args.only or list(variants()))
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
