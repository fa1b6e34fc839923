"""Each stage's core loop on CUDA with a real model's shape: SFT steps, GRPO steps (plain, and with the memory
knobs and loss variants: bf16 weights, LoRA over bf16 weights, 8-bit AdamW over bf16 weights' fp32 masters),
rejection-sampling generation, reward-model steps; and the static sampler's decode steps replayed as CUDA graphs
against the same steps run eagerly (batch 128, 256 tokens, the same random streams: the same tokens, and the time of
each). A check that the GPU path runs and learns something; the only timing is the graphs' against eager.

usage: python benchmarks/peers/gpu/make_model.py qwen2.5-0.5b /tmp/m && python benchmarks/gpu_smoke.py /tmp/m
       python benchmarks/gpu_smoke.py MODEL_DIR --device cpu      (the same code path on the CPU, for a tiny model)
MODEL_DIR is any folder `from_pretrained` opens with a `prompts.jsonl` of {prompt, answer} rows (gpu/make_model.py
makes one: random weights, a tokenizer that covers the whole vocabulary). On CUDA the loops run under bf16 autocast
over float32 weights (the recipes' setting), except the GRPO runs that hold bf16 weights. Prints one JSON line per
check (seconds, peak CUDA GiB, what it checked; a check that cannot run here says `skipped` and why: the graphs
need CUDA, 8-bit AdamW needs bitsandbytes, LoRA needs peft), then one line with the verdict, and exits non-zero at
the first failure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tokens", type=int, default=32, help="completion budget of the sampling checks")
    ap.add_argument("--replay-batch", type=int, default=128, help="rows of the graphs-against-eager check")
    ap.add_argument("--replay-tokens", type=int, default=256, help="decode steps of the graphs-against-eager check")
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch is imported: every loop then finds no GPU

    import pandas as pd
    import torch

    from grpo.configs.lora import LoRAConfig
    from grpo.configs.model import ModelConfig
    from grpo.configs.rejection import RejectionConfig
    from grpo.configs.reward import RewardModelConfig
    from grpo.configs.sampling import GenerationConfig, SamplingConfig
    from grpo.configs.training import GRPOConfig, SFTConfig
    from grpo.models import load_model_and_tokenizer
    from grpo.rejection.shards import process_shard
    from grpo.sampling.draws import draw_streams
    from grpo.sampling.engines import build_engine, sampling_dtype
    from grpo.sampling.local.static_sampler import StaticSampler
    from grpo.training.loops.grpo_trainer import GRPOTrainer
    from grpo.training.loops.reward_model import train_reward_model
    from grpo.training.loops.sft_trainer import train_sft

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device here (use --device cpu for the CPU path)")
    precision = "bf16" if cuda else "no"  # bf16 autocast is ~30x slower on CPUs without bf16 instructions
    rows = pd.read_json(Path(args.model_dir) / "prompts.jsonl", lines=True, dtype={"answer": str})
    sft_rows = pd.DataFrame({"prompt": rows["prompt"],
                             "response": [f"<think>{p[8:-1]} = {a}</think><answer>{a}</answer>"
                                          for p, a in zip(rows["prompt"], rows["answer"])]})

    def load():
        return load_model_and_tokenizer(model_cfg)

    def check(name: str, fn) -> None:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        what = fn()
        row = {"check": name, "seconds": round(time.perf_counter() - t, 2), **what}
        if cuda:
            row["peak_cuda_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        print(json.dumps(row), flush=True)

    skipped = {}

    def skip(name: str, why: str) -> None:
        skipped[name] = why
        print(json.dumps({"check": name, "skipped": why}), flush=True)

    def changed(model, before: dict) -> int:
        """How many parameter tensors differ from `before` (compared on the CPU, in float32)."""
        return sum(not torch.equal(p.detach().float().cpu(), before[n]) for n, p in model.named_parameters()
                   if n in before)

    def snapshot(model) -> dict:
        return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_cfg = ModelConfig(name_or_path=str(_with_chat_template(Path(args.model_dir), tmp / "base")))

        def sft():
            model, tok = load()
            before = snapshot(model)
            losses = []
            cfg = SFTConfig(max_steps=3, batch_size=4, learning_rate=1e-4, warmup_steps=0, max_seq_len=128,
                            mixed_precision=precision, gradient_checkpointing=True, checkpoint_every=0, log_every=1)
            result = train_sft(model, tok, sft_rows, cfg, tmp / "sft", lambda s, m: losses.append(m["train/loss"]),
                               progress=False)
            assert len(losses) == 3 and all(math.isfinite(v) for v in losses), losses
            assert changed(model, before) > 0, "SFT left the weights alone"
            assert (result.model_dir / "config.json").is_file()
            return {"losses": [round(v, 3) for v in losses]}

        def grpo(name: str, **overrides):
            def run():
                model, tok = load()
                before = snapshot(model)
                seen = []
                cfg = GRPOConfig(**{"max_steps": 2, "prompts_per_step": 4, "num_generations": 4,
                                    "sampling": SamplingConfig(max_new_tokens=args.tokens, batch_size=16),
                                    "learning_rate": 1e-5, "beta": 0.04, "rewards": {"digits": 1.0},
                                    "checkpoint_every": 0, "samples_every": 0, "micro_batch_size": 8,
                                    "mixed_precision": precision, **overrides})
                trainer = GRPOTrainer(model, tok, rows, cfg, tmp / name, progress=False,
                                      reward_functions={"digits": _digits}, on_metrics=lambda s, m: seen.append(m))
                result = trainer.train()
                assert len(seen) == 2, seen
                for m in seen:
                    assert all(math.isfinite(m[k]) for k in ("train/loss", "kl", "grad_norm", "entropy")), m
                trained = load_model_and_tokenizer(ModelConfig(name_or_path=str(result.model_dir)))[0]
                assert changed(trained, before) > 0, "GRPO left the weights alone"
                return {"step_s": [round(m["time/step_s"], 2) for m in seen],
                        "loss": [round(m["train/loss"], 4) for m in seen], "overrides": _jsonable(overrides)}
            return run

        def rejection():
            model, tok = load()
            # the stage's engine, sampling in the stage's precision (a bf16 copy of the fp32 weights on CUDA)
            backend = build_engine(GenerationConfig(), model.to("cuda" if cuda else "cpu"), tok,
                                   dtype=sampling_dtype(precision), who="rejection sampling")
            cfg = RejectionConfig(samples_per_prompt=4, sampling=SamplingConfig(max_new_tokens=args.tokens),
                                  target_samples=8, shard_size=8, judge_when="never")
            result = process_shard(backend, rows.head(8), cfg, judge=None, shard_index=0)
            assert len(result.samples) == 32 and result.samples["response"].map(len).sum() > 0
            return {"samples": len(result.samples), "kept": len(result.kept)}

        def graphs_vs_eager():
            """The static sampler with its decode step captured and replayed against the same step run eagerly:
            the same kernels on the same state, so the same streams give the same tokens; and the time of each."""
            model, tok = load()
            model.to("cuda").eval()
            tok.padding_side = "left"
            B, C = args.replay_batch, args.replay_tokens
            prompts = [rows["prompt"][i % len(rows)] for i in range(B)]
            enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
            s = SamplingConfig(max_new_tokens=C, temperature=1.0)
            u = draw_streams(B, generator=torch.Generator().manual_seed(0))  # [B] each row's random stream
            out = {}
            for way, graphs in (("graphs", True), ("eager", False)):
                # bf16 from the fp32 weights (as under autocast); every step over the whole cache in both ways
                sampler = StaticSampler(model, dtype=torch.bfloat16, graphs=graphs, keep_captures=True,
                                        full_cache_attention=True, buckets=True)
                sampler.sample(enc["input_ids"], enc["attention_mask"], s, [], tok.pad_token_id, streams=u)  # capture
                torch.cuda.synchronize()
                t = time.perf_counter()
                got = sampler.sample(enc["input_ids"], enc["attention_mask"], s, [], tok.pad_token_id, streams=u)
                torch.cuda.synchronize()
                out[way] = (time.perf_counter() - t, got)
                del sampler
            (t_graph, g), (t_eager, e) = out["graphs"], out["eager"]
            assert g.completion_ids.shape == (B, C), g.completion_ids.shape  # no end token: every step runs
            apart = int((g.completion_ids != e.completion_ids).any(1).sum())
            assert apart == 0, f"graph replay and eager decoding chose different tokens in {apart} of {B} rows"
            return {"batch": B, "new_tokens": C, "graphs_ms_per_step": round(1000 * t_graph / C, 2),
                    "eager_ms_per_step": round(1000 * t_eager / C, 2), "x_graphs": round(t_eager / t_graph, 2),
                    "same_tokens": True, "logprob_max_diff": float((g.logprobs - e.logprobs).abs().max())}

        def reward_model():
            pairs = pd.DataFrame({"prompt": rows["prompt"][:32],
                                  "chosen": [f"<answer>{a}</answer>" for a in rows["answer"][:32]],
                                  "rejected": [f"<answer>{int(a) + 1}</answer>" for a in rows["answer"][:32]]})
            seen = []
            cfg = RewardModelConfig(model=model_cfg, max_steps=3, batch_size=4, learning_rate=1e-5, warmup_steps=0,
                                    max_seq_len=128, eval_fraction=0.25, eval_batch_size=8,
                                    mixed_precision=precision, gradient_checkpointing=True, log_every=1)
            result = train_reward_model(pairs, cfg, tmp / "rm", lambda s, m: seen.append(m), progress=False)
            losses = [m["rm/loss"] for m in seen if "rm/loss" in m]
            assert losses and all(math.isfinite(v) for v in losses), seen
            return {"losses": [round(v, 3) for v in losses], "model_dir": result.model_dir.name}

        check("sft", sft)
        check("grpo", grpo("grpo"))
        check("grpo_memory_knobs", grpo("grpo_knobs", weights_dtype="bfloat16", gradient_checkpointing=True,
                                        loss_type="dapo", importance_sampling_level="sequence", micro_batch_size=4))
        if importlib.util.find_spec("peft"):
            check("grpo_lora", grpo("grpo_lora", lora=LoRAConfig(r=8), learning_rate=1e-4))
            check("grpo_lora_bf16", grpo("grpo_lora_bf16", lora=LoRAConfig(r=8), learning_rate=1e-4,
                                         weights_dtype="bfloat16"))
        else:
            skip("grpo_lora", "peft is not importable")
            skip("grpo_lora_bf16", "peft is not importable")
        if _importable("bitsandbytes"):
            check("grpo_adamw_8bit", grpo("grpo_8bit", optimizer="adamw_8bit"))
            check("grpo_bf16_adamw_8bit", grpo("grpo_bf16_8bit", optimizer="adamw_8bit", weights_dtype="bfloat16"))
        else:
            skip("grpo_adamw_8bit", "bitsandbytes is not importable")
            skip("grpo_bf16_adamw_8bit", "bitsandbytes is not importable")
        if cuda:
            check("sampler_graphs_vs_eager", graphs_vs_eager)
        else:
            skip("sampler_graphs_vs_eager", "CUDA graphs need a CUDA device")
        check("rejection_sampling", rejection)
        check("reward_model", reward_model)
    print(json.dumps({"gpu_smoke": "passed", "device": torch.cuda.get_device_name() if cuda else "cpu",
                      "skipped": skipped}))


def _with_chat_template(model_dir: Path, out: Path) -> Path:
    """`model_dir` as a folder whose tokenizer has a chat template (plain text, as the benchmarks feed prompts):
    links to its files, and the tokenizer saved anew. Every stage renders prompts through the template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.chat_template is not None:
        return model_dir
    out.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.is_file() and not f.name.startswith(("tokenizer", "special_tokens")):
            (out / f.name).symlink_to(f.resolve())
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(out)
    return out


def _importable(name: str) -> bool:
    """Whether `name` imports here (bitsandbytes can be installed and still fail to load its library)."""
    try:
        importlib.import_module(name)
    except Exception:  # noqa: BLE001 - any failure to load means the check cannot run
        return False
    return True


def _digits(completions, **_):
    """A reward with spread on random weights: the share of digits in the completion."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def _jsonable(overrides: dict) -> dict:
    return {k: (v.model_dump() if hasattr(v, "model_dump") else v) for k, v in overrides.items()}


if __name__ == "__main__":
    main()
