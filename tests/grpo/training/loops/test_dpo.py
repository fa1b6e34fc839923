"""DPO on real tiny models: the sigmoid and IPO losses against hand-worked numbers and a naive per-pair loop, a
step that raises the chosen response's log-ratio, an interrupted run that resumes to the uninterrupted run's
weights, LoRA, and the one-line errors of bad preference files."""

import json
import math

import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo.configs.dpo import DPOConfig
from grpo.configs.lora import LoRAConfig
from grpo.configs.reward import PreferenceDataConfig
from grpo.data.preferences import load_preference_data, preference_pairs
from grpo.data.tables import DataError
from grpo.models import load_model_and_tokenizer
from grpo.training.loops.dpo import dpo_loss, pair_batch, sequence_logps, tokenize_pairs, train_dpo
from tiny_configs import SMALL

PROMPT = "Give me a tip for running."
GOOD = "<think>A tip on running.</think><answer>Start slow, add a little distance each week and rest well.</answer>"
EMPTY = "<think></think><answer>Ok.</answer>"


class Interrupt(Exception):
    pass


# ----------------------------------------------------------------------------------------------------------------
# The loss


def naive_dpo(chosen, rejected, ref_chosen, ref_rejected, beta, loss_type):
    """One pair at a time in 0-d tensors: the margin of log-ratios, then -log σ(β·m) or (m - 1/(2β))²."""
    total = 0.0
    for c, r, rc, rr in zip(chosen, rejected, ref_chosen, ref_rejected):
        m = (c - rc.item()) - (r - rr.item())
        if loss_type == "sigmoid":
            total = total - torch.log(1 / (1 + torch.exp(-beta * m)))
        else:
            total = total + (m - 1 / (2 * beta)) ** 2
    return total / len(chosen)


def test_the_losses_on_hand_worked_numbers():
    # policy vs reference: chosen +1 nat, rejected -1 nat, so m = 2. β = 0.5: -log σ(1) = log(1 + e^-1) = 0.31326;
    # IPO: (2 - 1/(2·0.5))² = (2 - 1)² = 1
    args = torch.tensor([-4.0]), torch.tensor([-6.0]), torch.tensor([-5.0]), torch.tensor([-5.0])
    loss, stats = dpo_loss(*args, beta=0.5)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-1)), abs=1e-6)
    assert stats == pytest.approx({"dpo/accuracy": 1.0, "dpo/margin": 1.0, "dpo/chosen_reward": 0.5,
                                   "dpo/rejected_reward": -0.5})
    assert dpo_loss(*args, beta=0.5, loss_type="ipo")[0].item() == pytest.approx(1.0)
    # a policy equal to its reference: m = 0, the loss is log 2 and no pair counts as ranked right
    same = torch.tensor([-3.0, -2.0])
    loss, stats = dpo_loss(same, same, same, same, beta=0.1)
    assert loss.item() == pytest.approx(math.log(2)) and stats["dpo/accuracy"] == 0.0
    with pytest.raises(ValueError, match="unknown loss_type 'hinge'"):
        dpo_loss(same, same, same, same, loss_type="hinge")


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
@pytest.mark.parametrize("beta", [0.1, 2.0])
def test_loss_and_gradients_match_a_naive_per_pair_loop(loss_type, beta):
    torch.manual_seed(0)
    B = 6
    chosen0, rejected0 = torch.randn(B) * 3 - 20, torch.randn(B) * 3 - 20
    ref_c, ref_r = torch.randn(B) * 3 - 20, torch.randn(B) * 3 - 20
    chosen, rejected = chosen0.clone().requires_grad_(True), rejected0.clone().requires_grad_(True)
    loss, stats = dpo_loss(chosen, rejected, ref_c, ref_r, beta=beta, loss_type=loss_type)
    loss.backward()
    nc, nr = chosen0.clone().requires_grad_(True), rejected0.clone().requires_grad_(True)
    expected = naive_dpo(nc, nr, ref_c, ref_r, beta, loss_type)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert torch.allclose(chosen.grad, nc.grad, atol=1e-6) and torch.allclose(rejected.grad, nr.grad, atol=1e-6)
    # dL/d log π(o+) by hand (the rejected's is its negative): sigmoid -β·σ(-β·m)/B, ipo 2(m - 1/(2β))/B
    m = (chosen0 - ref_c) - (rejected0 - ref_r)
    coefficient = -beta * torch.sigmoid(-beta * m) / B if loss_type == "sigmoid" else 2 * (m - 1 / (2 * beta)) / B
    assert torch.allclose(chosen.grad, coefficient, atol=1e-6) and torch.allclose(rejected.grad, -coefficient, atol=1e-6)
    assert stats["dpo/accuracy"] == pytest.approx((m > 0).float().mean().item())


# ----------------------------------------------------------------------------------------------------------------
# Training on a real tiny model


def pairs_with_margin(model, tok, pairs):
    """(β-free) log-ratio of the chosen and of the rejected response against the starting model, pair by pair."""
    batch = pair_batch(tokenize_pairs(pairs, tok, 256), tok.pad_token_id)
    with torch.no_grad():
        return sequence_logps(model, batch)  # [2B]


def test_a_dpo_step_raises_the_chosen_log_ratio(tmp_path):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    pairs = preference_pairs(8)
    model, tok = load_model_and_tokenizer(SMALL)
    before = pairs_with_margin(model, tok, pairs)
    cfg = DPOConfig(max_steps=1, batch_size=8, learning_rate=1e-3, warmup_steps=0, lr_scheduler="constant",
                    mixed_precision="no", checkpoint_every=0, log_every=1, eval_fraction=0)
    logged = {}
    result = train_dpo(model, tok, pairs, cfg, tmp_path, lambda s, m: logged.setdefault(s, {}).update(m),
                       progress=False)
    trained = AutoModelForCausalLM.from_pretrained(result.model_dir)
    after = pairs_with_margin(trained, tok, pairs)
    B = len(pairs)
    chosen_ratio = after[:B] - before[:B]  # h(q, o+): log π/π_ref of the chosen responses after one step
    rejected_ratio = after[B:] - before[B:]
    assert chosen_ratio.mean() > 0 > rejected_ratio.mean()
    assert (chosen_ratio - rejected_ratio > 0).all()  # every pair's margin moved the right way
    # the first step's loss is log 2: the policy is its reference (to fp32 rounding: the reference pass and the
    # policy's run the same weights over other batch shapes, which an AVX-512 GEMM may block, and round, otherwise)
    assert logged[1]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert abs(logged[1]["dpo/margin"]) < 1e-5
    assert {"dpo/accuracy", "dpo/chosen_reward", "dpo/rejected_reward", "dpo/learning_rate",
            "dpo/grad_norm"} <= set(logged[1])
    assert math.isnan(result.heldout_metrics["dpo/heldout_accuracy"])  # no held-out pairs asked for


def run(tmp_path, on_metrics=None, **overrides):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, tok = load_model_and_tokenizer(SMALL)
    cfg = DPOConfig(**{"max_steps": 4, "batch_size": 4, "learning_rate": 1e-3, "mixed_precision": "no",
                       "checkpoint_every": 2, "log_every": 1, **overrides})
    return train_dpo(model, tok, preference_pairs(16), cfg, tmp_path, on_metrics,
                     heldout=preference_pairs(8, split="heldout"), progress=False)


def test_an_interrupted_run_resumes_to_the_same_weights(tmp_path):
    straight = run(tmp_path / "straight")

    def crash_at_3(step, _):
        if step == 3:
            raise Interrupt

    with pytest.raises(Interrupt):
        run(tmp_path / "resumed", crash_at_3)
    assert (tmp_path / "resumed" / "checkpoints" / "step-2").is_dir()
    steps = []
    resumed = run(tmp_path / "resumed", lambda s, m: steps.append(s))
    assert steps == [3, 4, 4]  # steps 3 and 4, then the held-out figures
    a = AutoModelForCausalLM.from_pretrained(straight.model_dir).state_dict()
    b = AutoModelForCausalLM.from_pretrained(resumed.model_dir).state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert resumed.heldout_metrics == pytest.approx(straight.heldout_metrics, abs=1e-5)
    assert not (tmp_path / "resumed" / "checkpoints").exists()  # the final model supersedes them


def test_lora_trains_adapters_against_the_base_and_saves_merged_weights(tmp_path):
    result = run(tmp_path, max_steps=2, checkpoint_every=0,
                 lora=LoRAConfig(r=4, target_modules=("q_proj", "v_proj")), learning_rate=1e-2)
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(result.model_dir).state_dict()
    base = load_model_and_tokenizer(SMALL)[0].state_dict()
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed and all("q_proj" in k or "v_proj" in k for k in changed)  # only the adapted weights moved
    assert result.heldout_metrics["dpo/heldout_accuracy"] >= 0.0


# ----------------------------------------------------------------------------------------------------------------
# Input checks


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_bad_preference_files_fail_in_one_line_naming_the_file_row_and_field(tmp_path):
    good = {"prompt": PROMPT, "chosen": GOOD, "rejected": EMPTY}

    def load(source):
        return load_preference_data(PreferenceDataConfig(source=source))

    cases = {
        "no_rejected.jsonl": ([{"prompt": PROMPT, "chosen": GOOD}], r"missing column\(s\) \['rejected'\]"),
        "empty.jsonl": ([good, {**good, "chosen": "  "}], r"row 1, column 'chosen': expected text or chat messages"),
        "tie.jsonl": ([good, good, {**good, "rejected": GOOD}], r"row 2, columns 'chosen' and 'rejected'"),
    }
    for name, (rows, message) in cases.items():
        with pytest.raises(DataError, match=message) as e:
            load(_write_jsonl(tmp_path / name, rows))
        assert name in str(e.value) and "\n" not in str(e.value)

    pd.DataFrame([good, {**good, "prompt": None}]).to_parquet(tmp_path / "no_prompt.parquet")
    with pytest.raises(DataError, match=r"no_prompt\.parquet: row 1, column 'prompt'"):
        load(str(tmp_path / "no_prompt.parquet"))

    # chat messages are read as the text they hold, and tokenize as it does
    messages = [{"prompt": [{"role": "user", "content": PROMPT}], "chosen": [{"role": "assistant", "content": GOOD}],
                 "rejected": [{"role": "assistant", "content": EMPTY}]}]
    pd.DataFrame(messages).to_parquet(tmp_path / "chat.parquet")
    pairs, heldout = load(str(tmp_path / "chat.parquet"))
    assert heldout is None
    _, tok = load_model_and_tokenizer(SMALL)
    assert tokenize_pairs(pairs, tok, 256) == tokenize_pairs(pd.DataFrame([good]), tok, 256)

    # a pair too long for the model fails before training, naming the row and column
    with pytest.raises(DataError, match=r"prefs: row 0, column 'chosen': prompt \+ response is \d+ tokens; expected "
                                        r"at most dpo.max_seq_len=30"):
        tokenize_pairs(pd.DataFrame([good]), tok, 30, source="prefs")
    model, _ = load_model_and_tokenizer(SMALL)
    with pytest.raises(DataError, match=r"prefs: 1 training pairs cannot fill a micro-batch of dpo.batch_size=4"):
        train_dpo(model, tok, pd.DataFrame([good]), DPOConfig(batch_size=4, eval_fraction=0), tmp_path,
                  source="prefs", progress=False)


def test_a_launched_process_runs_dpo_from_its_job_file(tmp_path):
    """What each process of a launched stage runs (grpo.training.launchers.worker), here in this process."""
    from grpo.training.jobs import DPOJob, Launched, read_launched
    from grpo.training.launchers.worker import run_job

    torch.set_num_threads(1)
    preference_pairs(8).to_parquet(tmp_path / "rows.parquet")
    preference_pairs(4, split="heldout").to_parquet(tmp_path / "heldout.parquet")
    cfg = DPOConfig(max_steps=2, batch_size=4, mixed_precision="no", checkpoint_every=0, log_every=1)
    job = DPOJob(model=SMALL, cfg=cfg, rows=str(tmp_path / "rows.parquet"), heldout=str(tmp_path / "heldout.parquet"),
                 source="prefs", output_dir=str(tmp_path / "out"))
    document = Launched(job=job, events=str(tmp_path / "events.jsonl"),
                        result=str(tmp_path / "result.json")).model_dump_json()
    run_job(read_launched(document))  # the job file, as a launched process reads it
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["steps"] == 2 and 0.0 <= result["heldout_metrics"]["dpo/heldout_accuracy"] <= 1.0
    assert AutoModelForCausalLM.from_pretrained(result["model_dir"]).config.num_hidden_layers == 2
    steps = [json.loads(line)["step"] for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 2]  # two steps, then the held-out figures
