"""Learning-rate schedules: the same rate as transformers' `get_scheduler` at every step, for every name a recipe
may give, and checkpoints from either resume in the other."""

import math

import pytest
import torch
from transformers import get_scheduler

from grpo.configs.training import LR_SCHEDULERS
from grpo.training.schedules import make_scheduler


def _optimizer(lr: float = 1e-3) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def _rates(scheduler, steps: int) -> list[float]:
    rates = []
    for _ in range(steps):
        rates.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("name", LR_SCHEDULERS)
@pytest.mark.parametrize("warmup,total", [(0, 10), (3, 10), (4, 7), (0, 1)])
def test_each_schedule_gives_transformers_rates(name, warmup, total):
    ours = make_scheduler(name, _optimizer(), num_warmup_steps=warmup, num_training_steps=total)
    theirs = get_scheduler(name, _optimizer(), num_warmup_steps=warmup, num_training_steps=total)
    expected = _rates(theirs, total + 3)  # past the end too: a resumed run may step beyond max_steps
    assert _rates(ours, total + 3) == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert len(set(expected)) > 1 or name == "constant" or (name == "constant_with_warmup" and not warmup)


def test_a_checkpointed_transformers_schedule_resumes_here():
    theirs = get_scheduler("cosine", _optimizer(), num_warmup_steps=2, num_training_steps=10)
    _rates(theirs, 4)
    ours = make_scheduler("cosine", _optimizer(), num_warmup_steps=2, num_training_steps=10)
    ours.load_state_dict(theirs.state_dict())
    assert ours.last_epoch == 4
    assert _rates(ours, 3) == pytest.approx(_rates(theirs, 3))


def test_polynomial_refuses_a_rate_it_cannot_decay_from():
    with pytest.raises(ValueError, match=r"polynomial.*\(1e-08\)"):
        make_scheduler("polynomial", _optimizer(lr=1e-8), num_warmup_steps=0, num_training_steps=10)
    assert math.isclose(make_scheduler("polynomial", _optimizer(), 0, 10).get_last_lr()[0], 1e-3)
