"""The paged-attention kernel (grpo.sampling.local.paged_kernel) under Triton's interpreter on a CPU, in a process of
its own: tests/grpo/sampling/local/test_paged_attention.py launches it and checks what it writes.

A process of its own because Triton reads TRITON_INTERPRET once, as it is imported (its kernels and its library's
own are made interpreted or compiled then), and torch imports Triton with torch._dynamo, which the test session
has loaded long before. fp32 throughout (the interpreter runs the kernel in numpy, which has no bf16), one thread.

usage: python tests/helpers/interpreted_kernel.py OUT.pt   (torch.save of a dict: the cases' inputs and results)
"""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports Triton

import torch  # noqa: E402

from grpo.sampling.local import paged_attention  # noqa: E402
from grpo.sampling.local.pages import page_bytes  # noqa: E402
from grpo.sampling.local.static_sampler import StaticSampler  # noqa: E402
from paged_cases import AS_CUDA, long_tailed, ragged_slots  # noqa: E402
from tiny_decoders import EOS, PAD  # noqa: E402


def run_kernel() -> dict:
    """One layer's attention for the slots of `ragged_slots`, on the kernel, with its count of what it read."""
    case = ragged_slots()
    read = torch.zeros(case["q"].size(0), dtype=torch.long)
    out = paged_attention.paged_decode(case["q"], case["k"], case["v"], case["table"], case["plen"], case["start"],
                                       case["at"], case["scale"], case["page"], use_kernel=True, read=read)
    return {"out": out, "read": read}


# the interpreter runs a kernel's programs one by one in numpy (some milliseconds each): few rows, short budgets
SAMPLED = {"preempted": dict(slots=4, budget_pages=7, temperature=1.0, lengths=(5, 11, 3, 7), repeat=2, budget=24),
           "greedy": dict(slots=None, budget_pages=None, temperature=0.0, lengths=(5, 2, 11), repeat=2, budget=20)}


def run_sampler(slots, budget_pages: int | None, temperature: float, lengths: tuple, repeat: int,
                budget: int) -> dict:
    """The captured layout (kept states whose attention reads the pages in place), stepped eagerly, on the kernel."""
    model, ids, mask, s, u = long_tailed(budget, temperature=temperature, lengths=lengths, repeat=repeat)
    memory = None if budget_pages is None else budget_pages * page_bytes(model, torch.float32)
    sampler = StaticSampler(model, memory_budget=memory, **AS_CUDA)
    got = sampler.sample(ids, mask, s, EOS, PAD, streams=u, slots=slots)
    st = next(iter(sampler._captures.values())).state
    c = sampler.counts
    return {"sampled": tuple(got), "layout": st.layout, "rows": st.by_length is not None, "preemptions": c.preemptions,
            "steps": c.steps, "kv_positions_read": c.kv_positions_read, "pages_in_use": st.pool.in_use}


def main(path: str) -> None:
    torch.set_num_threads(1)
    assert paged_attention.kernel_runs_on(torch.device("cpu")), "the interpreter is not on"
    results = {"kernel": run_kernel(), "sampled": {name: run_sampler(**kw) for name, kw in SAMPLED.items()}}
    torch.save(results, path)


if __name__ == "__main__":
    main(sys.argv[1])
