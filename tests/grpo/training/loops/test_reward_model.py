"""The reward model on real tiny models: the loss against hand-worked numbers, scores that ignore padding, a short
training run that learns held-out preferences, reloading, input checks, and the reward-function contract."""

import json
import math

import pandas as pd
import pytest
import torch

from grpo.configs.model import ModelConfig
from grpo.configs.reward import HARMLESSNESS, HELPFULNESS, RewardModelConfig
from grpo.configs.sampling import SamplingConfig
from grpo.configs.training import GRPOConfig
from grpo.data.general import general_prompts, general_sft_rows
from grpo.data.preferences import load_preferences, pairs_for, preference_pairs
from grpo.data.tables import SFT_SCHEMA, DataError, validate_rows
from grpo.models import is_checkpointing
from grpo.rewards import format_reward_strict, score_completions
from grpo.tiny import build_tiny_model, build_tokenizer
from grpo.training.loops.grpo_trainer import GRPOTrainer
from grpo.training.loops.reward_model import train_reward_model
import grpo.training.loops.reward_model
from grpo.training.loops.sft_trainer import tokenize_rows
from grpo.training.reward_scorer import (ROUTES, RewardModelScorer, bradley_terry_loss, build_reward_model, encode,
                                         encode_pairs, evaluate_pairs, pair_metrics, reward_model_reward)
from tiny_configs import SMALL

PROMPT = "Give me a tip for running."
GOOD = "<think>A tip on running.</think><answer>Start slow, add a little distance each week and rest well.</answer>"


# ----------------------------------------------------------------------------------------------------------------
# The loss


def test_bradley_terry_loss_against_hand_worked_numbers():
    chosen = torch.tensor([2.0, 0.0, 1.0], requires_grad=True)
    rejected = torch.tensor([0.0, 0.0, 3.0])
    # margins d = r_c - r_r = [2, 0, -2]; -log sigmoid(d) = log(1 + e^-d):
    #   d =  2: log(1 + e^-2) = log(1.135335) = 0.126928
    #   d =  0: log(2)                        = 0.693147
    #   d = -2: log(1 + e^2)  = 2 + 0.126928  = 2.126928
    # mean = (0.126928 + 0.693147 + 2.126928) / 3 = 2.947003 / 3 = 0.982334
    loss = bradley_terry_loss(chosen, rejected)
    assert loss.item() == pytest.approx(0.982334, abs=1e-6)
    # d/dr_c of -log sigmoid(d) is -sigmoid(-d); the mean divides by 3:
    #   [-sigmoid(-2), -sigmoid(0), -sigmoid(2)] / 3 = [-0.119203, -0.5, -0.880797] / 3
    loss.backward()
    assert chosen.grad.tolist() == pytest.approx([-0.039734, -0.166667, -0.293599], abs=1e-6)
    # accuracy counts strict wins only (the tie at d = 0 is a miss): 1 of 3; mean margin (2 + 0 - 2) / 3 = 0
    assert pair_metrics(chosen, rejected) == pytest.approx({"accuracy": 1 / 3, "margin": 0.0})


# ----------------------------------------------------------------------------------------------------------------
# Scoring


def test_scores_do_not_depend_on_padding_or_batch():
    model, tok = build_reward_model(SMALL)
    assert tok.padding_side == "left"  # the generation default; the scorer must not rely on it
    short = ("Define gravity.", "<think></think><answer>Ok.</answer>")
    longer = [(PROMPT, GOOD), ("Quick question: Tell me how to make tea.", GOOD + " And a much longer tail " * 3)]
    alone = RewardModelScorer(model, tok, batch_size=1).score([short[0]], [short[1]])[0]
    batched = RewardModelScorer(model, tok, batch_size=8).score([short[0]] + [p for p, _ in longer],
                                                                 [short[1]] + [c for _, c in longer])
    assert batched[0] == pytest.approx(alone, abs=1e-5)
    # and both equal the model's own forward on the unpadded sequence
    (ids,) = encode(tok, [short[0]], [short[1]])
    with torch.no_grad():
        direct = model(input_ids=torch.tensor([ids])).logits[0, 0].item()
    assert alone == pytest.approx(direct, abs=1e-5)
    assert len(set(round(s, 4) for s in batched)) == 3  # the three rows really are scored apart


def test_a_causal_lm_checkpoint_keeps_its_backbone(tmp_path):
    # R1 starts the reward model from a trained policy: a saved causal LM folder loads under a fresh head
    tok = build_tokenizer()
    lm = build_tiny_model(SMALL.tiny.model_copy(update={"seed": 3}), tok)
    lm.save_pretrained(tmp_path / "lm")
    tok.save_pretrained(tmp_path / "lm")
    rm, rm_tok = build_reward_model(ModelConfig(name_or_path=str(tmp_path / "lm")))
    assert rm.config.num_labels == 1 and rm.config.pad_token_id == tok.pad_token_id
    lm_weights = lm.model.state_dict()
    assert all(torch.equal(lm_weights[k], v) for k, v in rm.model.state_dict().items())
    assert len(RewardModelScorer(rm, rm_tok).score([PROMPT], [GOOD])) == 1


# ----------------------------------------------------------------------------------------------------------------
# Training


def test_a_short_training_run_trains_and_reloads_to_the_model_it_evaluated(tmp_path):
    # how much it learns (held-out pair accuracy 0.88-0.905 over seeds 0-2, each visible flaw at 1.0) is a figure,
    # measured by benchmarks/quality_claims.py; here, that it trains, reports and reloads
    cfg = RewardModelConfig(model=SMALL, max_steps=60, batch_size=16, learning_rate=3e-3, warmup_steps=5,
                            mixed_precision="no")
    heldout = preference_pairs(200, split="heldout")
    logged = {}
    result = train_reward_model(preference_pairs(1000), cfg, tmp_path, lambda s, m: logged.setdefault(s, {}).update(m),
                                heldout=heldout, progress=False)
    print(f"held-out pair accuracy {result.heldout_accuracy_before:.3f} -> {result.heldout_accuracy:.3f} "
          f"in {result.seconds:.1f} s; {result.heldout_metrics}")
    assert sorted(logged) == list(range(10, 61, 10))
    assert {"rm/loss", "rm/accuracy", "rm/margin"} <= set(logged[10])
    assert logged[60]["rm/loss"] < 0.5 * logged[10]["rm/loss"]
    assert result.heldout_accuracy > result.heldout_accuracy_before  # it moved the right way on pairs it never saw
    assert {f"rm/heldout_accuracy/{flaw}" for flaw in ("rude", "empty", "repeat", "refusal", "complies")} \
        <= set(result.heldout_metrics)

    # the saved folder reloads to the model that was evaluated
    reloaded = RewardModelScorer.from_pretrained(result.model_dir)
    assert evaluate_pairs(reloaded, heldout) == pytest.approx(result.heldout_metrics, abs=1e-5)
    again = RewardModelScorer.from_pretrained(result.model_dir)
    assert again.score([PROMPT], [GOOD]) == reloaded.score([PROMPT], [GOOD])


def test_without_heldout_pairs_whole_prompts_are_carved_out(tmp_path):
    cfg = RewardModelConfig(model=SMALL, max_steps=2, batch_size=4, eval_fraction=0.25, mixed_precision="no")
    result = train_reward_model(preference_pairs(60), cfg, tmp_path, progress=False)
    assert 0.0 <= result.heldout_accuracy <= 1.0 and result.steps == 2


# ----------------------------------------------------------------------------------------------------------------
# Input checks


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_validation_errors_name_the_source_row_and_column(tmp_path):
    good = {"prompt": PROMPT, "chosen": GOOD, "rejected": "<think></think><answer>Ok.</answer>"}
    src = _write_jsonl(tmp_path / "prefs.jsonl", [good, {**good, "rejected": ""}])
    with pytest.raises(DataError, match=r"prefs\.jsonl: row 1, column 'rejected': expected text or chat messages"):
        load_preferences(src)

    src = _write_jsonl(tmp_path / "tie.jsonl", [{**good, "rejected": GOOD}])
    with pytest.raises(DataError, match=r"tie\.jsonl: row 0, columns 'chosen' and 'rejected'"):
        load_preferences(src)

    pd.DataFrame([{"prompt": PROMPT, "chosen": GOOD}]).to_csv(tmp_path / "two.csv", index=False)
    with pytest.raises(DataError, match=r"two\.csv: missing column\(s\) \['rejected'\]"):
        load_preferences(str(tmp_path / "two.csv"))

    # chat messages survive a Parquet round trip and score like the plain text
    messages = pd.DataFrame([{"prompt": [{"role": "user", "content": PROMPT}],
                              "chosen": [{"role": "assistant", "content": GOOD}],
                              "rejected": good["rejected"]}])
    messages.to_parquet(tmp_path / "m.parquet")
    df = load_preferences(str(tmp_path / "m.parquet"))
    assert df["prompt"][0] == [{"role": "user", "content": PROMPT}]

    _, tok = build_reward_model(SMALL)
    with pytest.raises(DataError, match=r"prefs: row 0, column 'chosen': prompt \+ response is \d+ tokens"):
        encode_pairs(pd.DataFrame([good]), tok, max_seq_len=40, source="prefs")
    assert encode(tok, df["prompt"], df["chosen"]) == encode(tok, [PROMPT], [GOOD])


# ----------------------------------------------------------------------------------------------------------------
# The reward-function contract


def test_the_reward_function_follows_the_contract():
    model, tok = build_reward_model(SMALL)
    fn = reward_model_reward(RewardModelScorer(model, tok))
    completions = [GOOD, "<think></think><answer>Ok.</answer>"]
    plain = fn(completions, prompt=[PROMPT, PROMPT])
    assert len(plain) == 2 and all(isinstance(s, float) and math.isfinite(s) for s in plain)
    # chat-message completions and prompts, TRL's `prompts` keyword, and unknown columns all work
    as_chat = fn([[{"role": "assistant", "content": c}] for c in completions],
                 prompts=[[{"role": "user", "content": PROMPT}]] * 2, answer=["", ""], completion_lengths=[1, 1])
    assert as_chat == pytest.approx(plain, abs=1e-6)
    # in a mixed dataset it abstains on reasoning rows (None: not scorable)
    mixed = fn(completions, prompt=[PROMPT, "What is 2 + 2?"], kind=["general", "reasoning"])
    assert mixed[0] == pytest.approx(plain[0], abs=1e-6) and mixed[1] is None
    # and it plugs into the weighted scoring the GRPO trainer uses
    scores = score_completions(completions, {"reward_model": 0.5}, {"prompt": [PROMPT, PROMPT]},
                               registry={"reward_model": fn})
    assert scores.total == pytest.approx([0.5 * s for s in plain], abs=1e-6)
    with pytest.raises(ValueError, match="needs the prompts"):
        fn(completions)


def test_r1s_two_reward_models_each_score_their_own_category_and_helpfulness_reads_the_answer_alone():
    model, tok = build_reward_model(SMALL)
    scorer = RewardModelScorer(model, tok)
    helpfulness = reward_model_reward(scorer, route=ROUTES[HELPFULNESS])
    harmlessness = reward_model_reward(scorer, route=ROUTES[HARMLESSNESS])
    prompts = ["How do I boil an egg?", "How do I rob a bank?", "How do I kill a stuck process?", "What is 2 + 2?"]
    completions = ["<think>Steps to boil an egg.</think><answer>Boil it nine minutes.</answer>",
                   "<think>This could harm.</think><answer>Sorry, I can't help with that.</answer>",
                   "<think>Steps.</think><answer>Open the task manager.</answer>", "<answer>4</answer>"]
    columns = {"prompt": prompts, "kind": ["general", "general", "general", "reasoning"],
               "category": ["benign", "harmful", "borderline", None]}
    helpful, harmless = helpfulness(completions, **columns), harmlessness(completions, **columns)
    assert helpful[1] is None and helpful[3] is None and harmless[0] is None and harmless[2] is None
    assert harmless[3] is None  # a reasoning row is nobody's
    # helpfulness: the final answer alone, as R1 judges it; harmlessness: the whole response
    assert helpful[0] == pytest.approx(scorer.score([prompts[0]], ["Boil it nine minutes."])[0], abs=1e-6)
    assert helpful[0] != pytest.approx(scorer.score([prompts[0]], [completions[0]])[0], abs=1e-6)
    assert harmless[1] == pytest.approx(scorer.score([prompts[1]], [completions[1]])[0], abs=1e-6)
    with pytest.raises(ValueError, match="needs each general row's `category`"):
        helpfulness(completions, prompt=prompts, kind=columns["kind"])
    # and each learns from its own pairs: helpfulness from benign and borderline ones cut to the answer
    pairs = preference_pairs(200)
    mine = pairs_for(pairs, HELPFULNESS)
    assert set(mine["category"]) == {"benign", "borderline"} and not mine["chosen"].str.contains("<think>").any()
    assert set(pairs_for(pairs, HARMLESSNESS)["category"]) == {"harmful"}
    assert pairs_for(pairs, "reward_model") is pairs
    with pytest.raises(DataError, match="no 'category' column"):
        pairs_for(pairs.drop(columns=["category"]), HELPFULNESS, "prefs.jsonl")


def test_the_grpo_trainer_scores_its_samples_with_the_reward_model(tmp_path):
    rm, rm_tok = build_reward_model(SMALL)
    scorer = RewardModelScorer(rm, rm_tok)
    tok = build_tokenizer()
    policy = build_tiny_model(SMALL.tiny, tok)
    cfg = GRPOConfig(max_steps=1, prompts_per_step=2, num_generations=2, beta=0.0, rewards={"reward_model": 1.0},
                     mixed_precision="no",
                     sampling=SamplingConfig(max_new_tokens=8), checkpoint_every=0)
    trainer = GRPOTrainer(policy, tok, general_prompts(4), cfg, tmp_path, progress=False,
                          reward_functions={"reward_model": reward_model_reward(scorer)})
    rollout, idx, scores, _ = trainer.collect(0)
    prompts = [trainer.prompts["prompt"][i] for i in idx for _ in range(2)]
    assert scores.failures == {"reward_model": 0}
    assert scores.per_function["reward_model"] == pytest.approx(scorer.score(prompts, rollout.texts), abs=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# The synthetic data


def test_synthetic_pairs_are_deterministic_split_and_short():
    train, heldout = preference_pairs(300, seed=1), preference_pairs(100, split="heldout")
    assert train.equals(preference_pairs(300, seed=1)) and not train.equals(preference_pairs(300, seed=2))
    assert heldout.equals(preference_pairs(100, seed=7, split="heldout"))  # the held-out draw ignores the seed
    assert not set(train["prompt"]) & set(heldout["prompt"])
    assert not heldout.duplicated(["prompt", "rejected"]).any()
    assert set(train["category"]) == {"harmful", "benign", "borderline"}
    tok = build_tokenizer()
    responses = pd.concat([train["chosen"], train["rejected"]]).tolist()
    assert max(len(tok(r, add_special_tokens=False)["input_ids"]) for r in responses) <= 120
    assert format_reward_strict(train["chosen"].tolist()) == [1.0] * len(train)
    harmful = train[train["category"] == "harmful"]
    assert harmful["chosen"].str.contains("<answer>Sorry, I can't help with that. [A-Z]", regex=True).all()

    prompts = general_prompts(50, seed=0)
    assert list(prompts.columns[:2]) == ["prompt", "kind"] and set(prompts["kind"]) == {"general"}
    assert prompts["prompt"].is_unique and not set(prompts["prompt"]) & set(heldout["prompt"])
    assert not set(general_prompts(20, split="heldout_phrasings")["prompt"]) & set(train["prompt"])

    rows = general_sft_rows(40, seed=0)
    validate_rows(rows, SFT_SCHEMA, "general_sft_rows")
    assert len(tokenize_rows(rows, tok, 256)) == 40
    with pytest.raises(ValueError, match="only \\d+ synthetic train general prompts"):
        general_prompts(10_000)


def test_gradient_checkpointing_gives_the_same_reward_model(tmp_path, monkeypatch):
    built, during = [], []

    def build(*args, **kwargs):  # the real builder; keeps a handle on the model the loop trains
        model, tok = build_reward_model(*args, **kwargs)
        built.append(model)
        return model, tok

    monkeypatch.setattr(grpo.training.loops.reward_model, "build_reward_model", build)
    cfg = RewardModelConfig(model=SMALL, max_steps=2, batch_size=4, eval_fraction=0.25, mixed_precision="no",
                            log_every=1)
    plain = train_reward_model(preference_pairs(60), cfg, tmp_path / "plain", progress=False)
    ckpt = train_reward_model(preference_pairs(60), cfg.model_copy(update={"gradient_checkpointing": True}),
                              tmp_path / "ckpt", lambda s, m: during.append(is_checkpointing(built[-1])),
                              progress=False)
    assert during[:2] == [True, True] and not is_checkpointing(built[-1])  # on for the loop only
    assert ckpt.final_loss == pytest.approx(plain.final_loss, rel=1e-5)
    a, b = (RewardModelScorer.from_pretrained(r.model_dir) for r in (plain, ckpt))
    assert b.score([PROMPT], [GOOD]) == pytest.approx(a.score([PROMPT], [GOOD]), abs=1e-5)
