"""The GRPO trainer on a real tiny model: it moves probability the right way, survives degenerate batches, resumes."""

import math

import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo.configs.sampling import SamplingConfig
from grpo.configs.training import GRPOConfig
from grpo.models import activation_checkpointing, is_checkpointing, load_model_and_tokenizer
from grpo.rewards import REWARD_FUNCTIONS
from grpo.sampling.local.cpu_decoder import lean_decode_supported
from grpo.training.logprobs import token_logps
from grpo.training.loops.grpo_trainer import GRPOTrainer
from grpo.training.loss import grpo_loss
from grpo.training.optimizers import make_adamw
from tiny_configs import SMALL

pytestmark = pytest.mark.precision  # trains under `auto`: `make test` runs it under either CPU answer

PROMPTS = pd.DataFrame({"prompt": [f"Say {i}" for i in range(8)], "answer": [str(i) for i in range(8)]})


def digits(completions, **_):
    """Rewards a completion for each digit it holds: a random model writes some, unevenly."""
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def constant(completions, **_):
    return [1.0] * len(completions)


def raises(completions, **_):
    raise RuntimeError("broken reward")


def nan_reward(completions, **_):
    return [math.nan] * len(completions)


def wrong_length(completions, **_):
    return [1.0]


REGISTRY = {**REWARD_FUNCTIONS, "digits": digits, "constant": constant, "raises": raises, "nan": nan_reward,
            "wrong_length": wrong_length}


def make_trainer(tmp_path, rewards, registry=None, **overrides):
    model, tok = load_model_and_tokenizer(SMALL)
    cfg = GRPOConfig(**{"max_steps": 1, "prompts_per_step": 2, "num_generations": 4, "checkpoint_every": 0,
                        "sampling": SamplingConfig(max_new_tokens=8), "rewards": rewards, **overrides})
    seen = {}
    trainer = GRPOTrainer(model, tok, PROMPTS, cfg, tmp_path, reward_functions={**REGISTRY, **(registry or {})},
                          progress=False,
                          on_metrics=lambda step, m: seen.__setitem__(step, m))
    return trainer, seen


def test_a_step_raises_the_likelihood_of_rewarded_completions(tmp_path):
    torch.manual_seed(0)
    trainer, _ = make_trainer(tmp_path, {"digits": 1.0}, learning_rate=1e-2, beta=0.0,
                              sampling=SamplingConfig(max_new_tokens=24))
    rollout = trainer.sample([0, 1])
    rewards = trainer.score(rollout, [0, 1]).total
    assert len(set(rewards)) > 1, "the random model should write digits in some completions more than others"
    batch = trainer.build_batch(rollout, rewards)
    C = rollout.completion_ids.size(1)
    before, _ = token_logps(trainer.model, batch.input_ids, batch.attention_mask, C, 1.0)
    trainer.optimise(batch)
    with torch.no_grad():
        after, _ = token_logps(trainer.model, batch.input_ids, batch.attention_mask, C, 1.0)
    seq_change = ((after - before.detach()) * batch.completion_mask).sum(-1)  # [N]
    # sequences with positive advantage became more likely, negative ones less likely, on average
    assert seq_change[batch.advantages > 0].mean() > 0 > seq_change[batch.advantages < 0].mean()


@pytest.mark.parametrize("precision", ["bf16", "no"])
def test_an_update_with_spread_rewards_moves_the_weights_in_either_precision(tmp_path, precision):
    """bf16 autocast keeps fp32 weights and an fp32 optimizer: GRPO's own small learning rate (1e-5) still moves
    them once advantages are non-zero (bf16 given explicitly, so it runs on any CPU: emulated on an AVX2 one)."""
    import warnings

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "emulated, 30x slower" on a CPU without bf16
        trainer, _ = make_trainer(tmp_path, {"digits": 1.0}, mixed_precision=precision, learning_rate=1e-5,
                                  sampling=SamplingConfig(max_new_tokens=16))
    assert trainer.acc.mixed_precision == precision
    rollout = trainer.sample([0, 1])
    batch = trainer.build_batch(rollout, trainer.score(rollout, [0, 1]).total)
    assert batch.advantages.abs().max() > 0
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.optimise(batch)
    moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) == len(before), sorted(set(before) - set(moved))


def test_equal_rewards_give_no_gradient_and_leave_weights_alone(tmp_path):
    trainer, seen = make_trainer(tmp_path, {"constant": 1.0}, beta=0.0, learning_rate=1e-2)
    # on the CPU: the trainer may have moved the model to an accelerator
    before = {k: v.detach().cpu().clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "model").state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert seen[1]["reward/zero_std_groups"] == 1.0 and seen[1]["grad_norm"] == 0.0
    # the step's time in three parts; beta = 0: no reference forward at all
    parts = [seen[1][f"time/{k}_s"] for k in ("generation", "reference", "optimise")]
    assert parts[0] > 0 and 0 <= parts[1] < parts[2] and sum(parts) == pytest.approx(seen[1]["time/step_s"])


@pytest.mark.parametrize("masked", [False, True])
def test_every_completion_truncated_is_reported_and_harmless(tmp_path, masked):
    # the policy cannot end its turn (its end-of-turn logits pushed down), so all 8 tokens are used; format reward
    # is 0 for all, so no signal
    trainer, seen = make_trainer(tmp_path, {"format": 1.0}, beta=0.04, mask_truncated_completions=masked)
    ends = trainer.tokenizer.all_special_ids

    def never_ends(module, args, logits):
        logits[..., ends] = -1e4
        return logits

    trainer.model.get_output_embeddings().register_forward_hook(never_ends)
    trainer.train()
    m = seen[1]
    assert m["completion_truncated"] == 1.0 and m["completion_length"] == 8.0
    assert m["reward/format"] == 0.0 and m["reward/zero_std_groups"] == 1.0
    assert all(math.isfinite(v) for v in m.values())
    if masked:  # no token left in the loss: not even the KL term pulls on the weights
        assert m["train/loss"] == 0.0 and m["grad_norm"] == 0.0


@pytest.mark.parametrize("bad, reason", [("raises", "raised"), ("nan", "not_a_number"),
                                         ("wrong_length", "wrong_length")])
def test_a_broken_reward_function_is_counted_not_fatal(tmp_path, bad, reason):
    trainer, seen = make_trainer(tmp_path, {bad: 1.0, "digits": 1.0}, beta=0.0)
    trainer.train()
    m = seen[1]
    assert m[f"reward_failures/{bad}"] == 8.0  # 2 prompts x 4 completions, every one unscorable
    # ungraded, not 0: no row has a reward, so none trains (and the step says so)
    assert m[f"reward_ungraded/{bad}/{reason}"] == 8.0 and m["reward/ungraded_share"] == 1.0
    assert math.isnan(m[f"reward/{bad}"]) and math.isnan(m["reward/total"])
    assert m["train/loss"] == 0.0 and m["grad_norm"] == 0.0


def flaky(completions, **_):
    """Grades the first half of its rows; the others it cannot (a check that timed out)."""
    from grpo.rewards.outcomes import TIMEOUT, Ungraded

    half = len(completions) // 2
    return [float(sum(ch.isdigit() for ch in c)) if i % 4 < 2 else Ungraded(TIMEOUT) for i, c in
            enumerate(completions)][:half * 2] + [Ungraded(TIMEOUT)] * (len(completions) - half * 2)


def test_ungraded_rows_train_nothing_and_their_groups_use_the_graded_rows(tmp_path):
    """Rows 2-3 of each group of 4 ungraded: the advantages are the formula over rows 0-1 alone, the ungraded rows
    have no loss token, and the step reports the share and the reason."""
    from grpo.training.advantages import group_advantages

    trainer, seen = make_trainer(tmp_path, {"flaky": 1.0}, {"flaky": flaky}, beta=0.04)
    rollout = trainer.sample([0, 1])
    scores = trainer.score(rollout, [0, 1])
    assert scores.graded == [True, True, False, False] * 2
    batch = trainer.build_batch(rollout, scores.total, None, scores.graded)
    graded = torch.tensor([scores.total[i] for i in (0, 1, 4, 5)])
    expected = group_advantages(graded, 2)  # the formula on the graded rows alone
    assert torch.equal(batch.advantages[[0, 1, 4, 5]].cpu(), expected)
    assert batch.advantages[[2, 3, 6, 7]].abs().sum() == 0 and batch.completion_mask[[2, 3, 6, 7]].sum() == 0
    assert torch.equal(batch.completion_mask[[0, 1, 4, 5]].cpu(), rollout.completion_mask[[0, 1, 4, 5]].float())

    trainer.train()
    m = seen[1]
    assert m["reward/ungraded_share"] == 0.5 and m["reward_ungraded/flaky/timeout"] == 4.0
    table = trainer._samples_table(rollout, [0, 1], scores)
    assert table["ungraded"].tolist() == ["", "", "flaky: timeout", "flaky: timeout"] * 2
    assert table["reward"].isna().tolist() == [False, False, True, True] * 2


def test_past_the_ungraded_limit_the_stage_stops_in_one_line_keeps_its_steps_and_resumes(tmp_path):
    """A grader that breaks at step 3 of 6: the stage stops once the window's ungraded share passes the limit,
    naming the grader and its reason, with steps 1-3 saved; fixed, the same trainer resumes at step 4."""
    from grpo.training.grading import GradingStop

    broken = {"from": 3}

    def grader(completions, **_):
        broken["calls"] = broken.get("calls", 0) + 1
        if broken["calls"] > broken["from"]:
            raise RuntimeError("the verifier's service is down")
        return digits(completions)

    def run():
        return make_trainer(tmp_path, {"grader": 1.0}, {"grader": grader}, max_steps=6, max_ungraded_share=0.05,
                            ungraded_window=2)

    trainer, seen = run()
    with pytest.raises(GradingStop) as stop:
        trainer.train()
    line = str(stop.value)
    assert "\n" not in line and line.startswith("GRPO stopped before step 4: 8 of the last 16 rows (50%, over 2 steps)")
    assert "the grader 'grader' most often, for raised (8 rows)" in line and "resumes at step 4" in line
    assert sorted(seen) == [1, 2, 3] and (tmp_path / "checkpoints" / "step-3").is_dir()

    broken["from"] = 10**9  # fixed
    trainer, seen = run()
    trainer.train()
    assert sorted(seen) == [4, 5, 6] and all(seen[s]["reward/ungraded_share"] == 0.0 for s in seen)


def test_a_run_without_reward_spread_says_so_and_stops_where_asked(tmp_path, caplog):
    trainer, seen = make_trainer(tmp_path / "says", {"constant": 1.0}, max_steps=3, no_signal_steps=2)
    with caplog.at_level("WARNING", logger="grpo.training.grading"):
        trainer.train()
    lines = [r.getMessage() for r in caplog.records if "no learning signal" in r.getMessage()]
    assert lines == ["GRPO: no learning signal for 2 steps in a row (steps 1-2): every group's rewards tie, so every "
                     "advantage is 0 and only the KL term acts. The prompts may be too hard or too easy for the "
                     "policy, or a reward may score everything alike"]
    assert sorted(seen) == [1, 2, 3]

    from grpo.training.grading import GradingStop

    trainer, seen = make_trainer(tmp_path / "stops", {"constant": 1.0}, max_steps=3, no_signal_steps=2,
                                 stop_without_signal=True)
    with pytest.raises(GradingStop,
                       match=r"no learning signal for 2 steps .* stopped \(grpo.grading.stop_without_signal\)"):
        trainer.train()
    assert sorted(seen) == [1]


def test_an_empty_completion_is_scored_and_trained_on(tmp_path):
    trainer, seen = make_trainer(tmp_path, {"format": 1.0, "digits": 1.0}, beta=0.04)
    tok = trainer.tokenizer
    r = trainer.sample([0])
    eos = tok.eos_token_id
    # the first completion ends at once: one end-of-turn token, empty text
    ids = r.completion_ids.clone()
    ids[0] = tok.pad_token_id
    ids[0, 0] = eos
    mask = r.completion_mask.clone()
    mask[0] = 0
    mask[0, 0] = 1
    r = r._replace(completion_ids=ids, completion_mask=mask, texts=[""] + r.texts[1:],
                   truncated=torch.cat([torch.tensor([False]), r.truncated[1:]]))
    scores = trainer.score(r, [0])
    assert scores.per_function["format"][0] == 0.0 and scores.per_function["digits"][0] == 0.0
    stats = trainer.optimise(trainer.build_batch(r, scores.total))
    assert all(math.isfinite(v) for v in stats.values())


def test_unknown_reward_fails_before_any_sampling(tmp_path):
    with pytest.raises(ValueError, match="unknown reward function"):
        make_trainer(tmp_path, {"acuracy": 1.0})


def test_dynamic_sampling_refills_groups_with_spread(tmp_path):
    from grpo.training.batches import prompt_order

    first = set(prompt_order(len(PROMPTS), 0, 2, seed=0))  # the step's own prompts

    def flat_on_first_draw(completions, answer, **_):
        """No spread for the step's own prompts, digit counts (spread) for any other prompt."""
        return [0.0 if int(a) in first else float(sum(ch.isdigit() for ch in c)) for c, a in zip(completions, answer)]

    REGISTRY["flat_on_first_draw"] = flat_on_first_draw
    torch.manual_seed(0)
    trainer, seen = make_trainer(tmp_path, {"flat_on_first_draw": 1.0}, dynamic_sampling=True, max_refill_rounds=4,
                                 beta=0.0, sampling=SamplingConfig(max_new_tokens=24))
    trainer.train()
    m = seen[1]
    assert m["dynamic/first_draw_zero_std_groups"] == 1.0 and m["dynamic/refill_rounds"] >= 1
    assert m["dynamic/groups"] == 2.0 and m["reward/zero_std_groups"] == 0.0  # refilled with groups that have spread


def test_dynamic_sampling_reads_its_first_draw_over_the_graded_rows(tmp_path):
    """Rows 2-3 of each group ungraded, the others rewarded 1.0: the first draw's reward is 1.0, not a mean that
    counts the ungraded rows' partial totals (0.0) as rewards; their share is reported beside it."""
    from grpo.rewards.outcomes import TIMEOUT, Ungraded

    def half_ungraded(completions, **_):
        return [1.0 if i % 4 < 2 else Ungraded(TIMEOUT) for i in range(len(completions))]

    trainer, seen = make_trainer(tmp_path, {"half": 1.0}, {"half": half_ungraded}, dynamic_sampling=True,
                                 max_refill_rounds=1, beta=0.0)
    trainer.train()
    assert seen[1]["dynamic/first_draw_reward"] == 1.0 and seen[1]["dynamic/first_draw_ungraded_share"] == 0.5


class Interrupt(Exception):
    pass


def test_an_interrupted_run_resumes_to_the_same_weights(tmp_path):
    common = {"max_steps": 4, "checkpoint_every": 2, "beta": 0.04, "learning_rate": 1e-3}
    trainer, _ = make_trainer(tmp_path / "straight", {"digits": 1.0}, **common)
    trainer.train()

    trainer, _ = make_trainer(tmp_path / "resumed", {"digits": 1.0}, **common)

    def crash_at_3(step, _):
        if step == 3:
            raise Interrupt

    trainer.on_metrics = crash_at_3
    with pytest.raises(Interrupt):
        trainer.train()
    steps = []
    trainer, _ = make_trainer(tmp_path / "resumed", {"digits": 1.0}, **common)
    trainer.on_metrics = lambda s, _: steps.append(s)
    trainer.train()
    assert steps == [3, 4]
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "straight" / "model").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "resumed" / "model").state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_adamw_is_fused_on_cpu_and_steps_like_the_plain_one():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model[0].requires_grad_(False)  # frozen parameters are left out
    twin = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    twin.load_state_dict(model.state_dict())
    fused = make_adamw(model, 1e-2, 0.01)
    assert fused.defaults["fused"] is True
    assert [p for g in fused.param_groups for p in g["params"]] == list(model[1].parameters())
    plain = torch.optim.AdamW(twin[1].parameters(), lr=1e-2, weight_decay=0.01)
    x = torch.randn(16, 8)
    for _ in range(3):
        for m, opt in ((model, fused), (twin, plain)):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _saved_bytes_and_grads(model, batch, C):
    """Loss gradients of one GRPO micro-batch and the bytes autograd keeps for its backward (counted once each)."""
    seen, total = set(), [0]

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total[0] += t.untyped_storage().nbytes()
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logps, _ = token_logps(model, batch.input_ids, batch.attention_mask, C, 1.0)
        loss, _ = grpo_loss(logps, None, batch.ref_logps, batch.advantages, batch.completion_mask, beta=0.04)
    loss.backward()
    return total[0], {n: p.grad.clone() for n, p in model.named_parameters()}


def test_gradient_checkpointing_gives_the_same_gradients_and_keeps_less(tmp_path):
    torch.manual_seed(0)
    # gradients compared to 1e-4: in fp32, whatever `auto` gives on this CPU (bf16 rounds each recomputed
    # activation anew, so the two passes differ by bf16's resolution)
    trainer, _ = make_trainer(tmp_path, {"digits": 1.0}, sampling=SamplingConfig(max_new_tokens=16),
                              mixed_precision="no")
    rollout = trainer.sample([0, 1])
    batch = trainer.build_batch(rollout, [float(i % 3) for i in range(8)])
    C = batch.completion_mask.size(1)
    policy = trainer.model
    policy.train()
    kept, grads = _saved_bytes_and_grads(policy, batch, C)
    with activation_checkpointing(policy):
        assert is_checkpointing(policy) and not policy.config.use_cache
        assert lean_decode_supported(policy)  # no input hook left behind: sampling keeps the fast path
        kept_ckpt, grads_ckpt = _saved_bytes_and_grads(policy, batch, C)
    assert not is_checkpointing(policy) and policy.config.use_cache  # the model's own state is back
    assert kept_ckpt < 0.5 * kept
    for name, g in grads.items():
        torch.testing.assert_close(grads_ckpt[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_a_checkpointing_run_trains_and_hands_back_a_plain_model(tmp_path):
    torch.manual_seed(0)
    trainer, seen = make_trainer(tmp_path, {"digits": 1.0}, max_steps=2, gradient_checkpointing=True)
    during = []  # whether the policy was checkpointing at each step's metrics
    record = trainer.on_metrics
    trainer.on_metrics = lambda step, m: (during.append(is_checkpointing(trainer.model)), record(step, m))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result = trainer.train()
    assert during == [True, True]
    assert sorted(seen) == [1, 2] and all(math.isfinite(m["train/loss"]) for m in seen.values())
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert not is_checkpointing(trainer.model)
    assert AutoModelForCausalLM.from_pretrained(result.model_dir).config.use_cache


@pytest.mark.parametrize("masked", [True, False])
def test_truncated_completions_can_be_left_out_of_the_loss(tmp_path, masked):
    torch.manual_seed(0)
    trainer, _ = make_trainer(tmp_path, {"digits": 1.0}, mask_truncated_completions=masked)
    rollout = trainer.sample([0, 1])
    rollout = rollout._replace(truncated=torch.tensor([True, False] * 4))  # every other completion cut off
    batch = trainer.build_batch(rollout, [float(i % 3) for i in range(8)])
    kept = rollout.completion_mask.float()
    assert torch.equal(batch.completion_mask[1::2], kept[1::2])
    assert torch.equal(batch.completion_mask[::2], torch.zeros_like(kept[::2]) if masked else kept[::2])
    # a truncated row's advantage reaches the gradient only when truncated rows are not masked
    C = batch.completion_mask.size(1)
    trainer.model.train()
    _, grads = _saved_bytes_and_grads(trainer.model, batch, C)
    flipped = batch._replace(advantages=torch.where(torch.arange(8) % 2 == 0, -batch.advantages, batch.advantages))
    _, grads_flipped = _saved_bytes_and_grads(trainer.model, flipped, C)
    same = all(torch.allclose(grads[n], grads_flipped[n], atol=1e-7) for n in grads)
    assert same == masked


def _step_gradients(trainer, batch, **cfg) -> dict[str, torch.Tensor]:
    """The gradients one optimizer step of `optimise` applies, with these settings (micro_batch_size, loss_type...)."""
    grads = {}

    def record(optimizer, args, kwargs):
        grads.update({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})

    handle = trainer.optimizer.optimizer.register_step_pre_hook(record)  # the optimizer accelerate wraps
    trainer.cfg = trainer.cfg.updated(**cfg)
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    try:
        trainer.optimise(batch)
    finally:
        handle.remove()
        with torch.no_grad():  # the step moved the weights: put them back, so every call sees the same model
            for n, p in trainer.model.named_parameters():
                p.copy_(weights[n])
    return grads


def test_micro_batches_accumulate_the_whole_batch_gradient(tmp_path):
    """Micro-batches of 3 rows (uneven, and cutting a group of 4) give the one-batch gradient for every loss type
    and ratio level but bnpo, whose token mean is per micro-batch (TRL's definition; dapo is the whole batch's)."""
    torch.manual_seed(0)
    # gradients compared to 1e-4: in fp32, whatever `auto` gives on this CPU (under bf16 a micro-batch of 3 rows
    # and one of 8 round differently, by far more than that)
    trainer, _ = make_trainer(tmp_path, {"digits": 1.0}, beta=0.04, sampling=SamplingConfig(max_new_tokens=16),
                              mixed_precision="no")
    rollout = trainer.sample([0, 1])
    completion_mask = rollout.completion_mask.clone()
    completion_mask[:3, 4:] = 0  # the first micro-batch holds fewer tokens than its share of rows
    rollout = rollout._replace(completion_mask=completion_mask)
    batch = trainer.build_batch(rollout, [float(i % 3) for i in range(8)])
    for level in ("token", "sequence"):
        for loss_type in ("dapo", "grpo", "dr_grpo", "bnpo"):
            kw = dict(loss_type=loss_type, importance_sampling_level=level)
            whole = _step_gradients(trainer, batch, micro_batch_size=8, **kw)
            parts = _step_gradients(trainer, batch, micro_batch_size=3, **kw)
            same = all(torch.allclose(parts[n], g, rtol=1e-4, atol=1e-7) for n, g in whole.items())
            assert same == (loss_type != "bnpo"), (loss_type, level)


def test_truncated_importance_sampling_sees_an_fp32_sampler_agree_with_the_trainer(tmp_path):
    # in fp32 the static sampler's log-probs are the trainer's forward up to rounding: weights ~1, gap ~0
    torch.manual_seed(0)
    trainer, seen = make_trainer(tmp_path, {"digits": 1.0}, tis_cap=2.0, mixed_precision="no", beta=0.0)
    trainer.train()
    m = seen[1]
    assert 0 <= m["tis/logp_diff_mean"] <= m["tis/logp_diff_max"] < 1e-4
    assert m["tis/weight_mean"] == pytest.approx(1.0, abs=1e-4)


def test_on_a_gpu_auto_checkpoints_activations_and_keeps_a_bf16_reference():
    """`gradient_checkpointing: auto` and `reference_dtype: auto` decide from where the loop trains: on a GPU in bf16
    the memory-saving choices, on a CPU the fast ones; an explicit setting wins either way."""
    from types import SimpleNamespace

    from grpo.configs.training import GRPOConfig
    from grpo.training.policy import checkpointing_on, reference_dtype

    gpu = SimpleNamespace(device=torch.device("cuda"), mixed_precision="bf16")  # what an Accelerator reports
    cpu = SimpleNamespace(device=torch.device("cpu"), mixed_precision="bf16")
    auto = GRPOConfig()
    assert (checkpointing_on(auto, gpu), checkpointing_on(auto, cpu)) == (True, False)
    assert (reference_dtype(auto, gpu), reference_dtype(auto, cpu)) == (torch.bfloat16, None)
    assert reference_dtype(auto, SimpleNamespace(device=torch.device("cuda"), mixed_precision="no")) is None
    off = GRPOConfig(gradient_checkpointing=False, reference_dtype="float32")
    assert (checkpointing_on(off, gpu), reference_dtype(off, gpu)) == (False, None)
    on = GRPOConfig(gradient_checkpointing=True, reference_dtype="bfloat16")
    assert (checkpointing_on(on, cpu), reference_dtype(on, cpu)) == (True, torch.bfloat16)


def test_a_step_logs_what_its_decode_steps_did(tmp_path):
    # the local engine's slots and pages, per step (`sampler/...`): 2 prompts x 4 samples of at most 16 tokens
    trainer, seen = make_trainer(tmp_path, {"digits": 1.0}, max_steps=2, sampling=SamplingConfig(max_new_tokens=16))
    trainer.train()
    for step in (1, 2):
        m = seen[step]
        assert 1 <= m["sampler/decode_steps"] <= 15  # a row's first token comes from the prefill
        assert 0 < m["sampler/live_share"] <= 1
        assert m["sampler/kv_read_per_token"] >= 1 and m["sampler/kv_mb"] > 0
        assert m["sampler/pages_high_water"] >= 2 and m["sampler/preemptions"] == 0  # no cap on a CPU's pool


def test_dynamic_sampling_watches_the_rows_of_the_groups_it_drops(tmp_path):
    """The step's own prompts cannot be graded (their groups carry no signal and are dropped), the refills can: the
    kept batch is all graded, yet half of what the step sampled was not, and the watch stops on that share."""
    from grpo.rewards.outcomes import TIMEOUT, Ungraded
    from grpo.training.batches import prompt_order
    from grpo.training.grading import GradingStop

    first = set(prompt_order(len(PROMPTS), 0, 2, seed=0))  # the step's own prompts

    def ungraded_on_first_draw(completions, answer, **_):
        return [Ungraded(TIMEOUT) if int(a) in first else float(sum(ch.isdigit() for ch in c))
                for c, a in zip(completions, answer)]

    torch.manual_seed(0)
    trainer, seen = make_trainer(tmp_path, {"grader": 1.0}, {"grader": ungraded_on_first_draw},
                                 dynamic_sampling=True, max_refill_rounds=4, beta=0.0, max_ungraded_share=0.3,
                                 ungraded_window=1, sampling=SamplingConfig(max_new_tokens=24))
    with pytest.raises(GradingStop, match=r"GRPO stopped before step 1: 8 of the last (16|24) rows .* the grader "
                                          r"'grader' most often, for timeout \(8 rows\)"):
        trainer.train()
    assert seen == {}  # stopped before the step trained
