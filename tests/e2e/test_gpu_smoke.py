"""`benchmarks/gpu_smoke.py`, the script a GPU machine runs first, on its CPU path with a tiny Qwen2 folder.

A GPU is lent to few sessions and the script runs only there, so a break in it (an import that moved, a setting
renamed) would otherwise first show on the GPU, costing that session its device time. On the CPU every check runs
the same code as on CUDA except the CUDA-graph replay, which says it was skipped.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

ROOT = Path(__file__).resolve().parents[2]


def _model_folder(out: Path) -> Path:
    """A random 2-layer Qwen2 with a byte-level tokenizer and 32 `What is a + b?` prompts, as gpu/make_model.py
    lays out a preset's folder."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|pad|>", eos_token="<|endoftext|>")
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    with open(out / "prompts.jsonl", "w") as f:
        for a in range(10, 42):
            f.write(json.dumps({"prompt": f"What is {a} + {a + 7}?", "answer": str(2 * a + 7)}) + "\n")
    return out


def test_gpu_smoke_runs_every_check_on_the_cpu(tmp_path):
    model = _model_folder(tmp_path / "model")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_smoke.py"), str(model), "--device", "cpu",
                          "--tokens", "8"], capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    verdict = rows[-1]
    assert verdict["gpu_smoke"] == "passed" and verdict["device"] == "cpu", verdict
    ran = {r["check"] for r in rows if "check" in r and "skipped" not in r}
    assert {"sft", "grpo", "grpo_memory_knobs", "grpo_lora", "grpo_lora_bf16", "rejection_sampling",
            "reward_model"} <= ran, ran
    # only what needs CUDA (or bitsandbytes, where it is not installed) may be skipped
    assert set(verdict["skipped"]) <= {"sampler_graphs_vs_eager", "grpo_adamw_8bit", "grpo_bf16_adamw_8bit"}
    assert "sampler_graphs_vs_eager" in verdict["skipped"]
