"""GGUF files written by the tests: a small Llama model and its byte-level BPE tokenizer in llama.cpp's layout
(tensor names, the rotary permutation of q and k, the tokenizer as metadata), through the `gguf` package's writer.
F32 tensors throughout, so the model read back must equal the one written, to the bit, wherever transformers
undoes llama.cpp's layout correctly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from grpo.tiny import build_tokenizer

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def small_llama(seed: int = 0) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """A 2-layer Llama with grouped-query attention and a tied head, over the tiny model's BPE vocabulary."""
    tok = build_tokenizer("bpe", 512)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                         bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so a norm read into the wrong place shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model, tok


def _permuted(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's order of a q or k projection's rows: each head's rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, path: Path,
                     architecture: str = "llama") -> Path:
    """`model` and `tok` as one GGUF file at `path` (F32 tensors; `architecture` as the file declares it)."""
    import gguf

    c = model.config
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("small-llama")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"] if hasattr(c, "rope_parameters") else c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab] + [a["content"] for a in sorted(spec["added_tokens"], key=lambda a: a["id"])
                                      if a["id"] >= len(vocab)]
    assert [tokens.index(t) for t in tokens] == list(range(len(tokens)))  # ids are positions, no gaps
    special = {a["content"] for a in spec["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tok.pad_token_id)
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_pad_token_id(tok.pad_token_id)
    writer.add_chat_template(CHAT_TEMPLATE)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    for i in range(c.num_hidden_layers):
        for hf, ours in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"),
                         ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
                         ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"),
                         ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down")):
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{ours}.weight"
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":  # tied: a GGUF without output.weight says so
            continue
        w = tensor.detach().float().numpy()
        if ".q_proj." in name:
            w = _permuted(w, c.num_attention_heads)
        elif ".k_proj." in name:
            w = _permuted(w, c.num_key_value_heads)
        writer.add_tensor(names[name], np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def install_distribution(site: Path, name: str, version: str, files: dict[str, Path]) -> None:
    """A distribution `name` installed into the folder `site` (put it on sys.path): a dist-info whose RECORD lists
    `files` (the path inside the distribution -> a file copied there), as pip leaves one."""
    folder = site / f"{name.replace('-', '_')}-{version}.dist-info"
    folder.mkdir(parents=True)
    (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    record = [f"{folder.name}/METADATA,,", f"{folder.name}/RECORD,,"]
    for inside, source in files.items():
        target = site / inside
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(source.read_bytes())
        record.append(f"{inside},,")
    (folder / "RECORD").write_text("\n".join(record) + "\n")
