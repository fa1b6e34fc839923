"""The paged-attention kernel (grpo.sampling.local.paged_kernel, what a CUDA step runs) on a CPU, under Triton's
interpreter, against attention written out position by position and against the torch reference: ragged lengths,
rows ending on and one past a page boundary, a 64-position block crossed, a shared prompt page, a resumed row's
prefix ending mid-page, a free slot; then the captured layout of the sampler on the kernel, refilling slots and
preempting and resuming rows, against the eager steps and against greedy decoding by a full forward without cache.

The kernel runs in a process of its own (tests/helpers/interpreted_kernel.py, once for the module): Triton reads
TRITON_INTERPRET once, when it is imported, and torch imports it with torch._dynamo long before any test runs. fp32
and one thread there and here.

What the interpreter cannot show, and why: the kernel's bf16 path (the interpreter runs in numpy, which has no bf16)
and its TF32 dot (`IEEE` off: numpy multiplies in fp32 whatever the precision asked); CUDA graph capture and replay
(they need a CUDA device); and the compiled kernel itself: the interpreter runs the kernel's Python, so this holds
its indexing, masking, online softmax and count, not Triton's compiler (benchmarks/paged_attention.py and
benchmarks/gpu_smoke.py check those on a GPU). Skipped where Triton is not installed; where the dev extra installs it
(Linux x86-64, by the marker on its line in pyproject.toml) a missing Triton also fails one test, with one line."""

import importlib.util
import os
import subprocess
import sys
import tomllib

import pytest
import torch
from packaging.requirements import Requirement

from grpo.sampling.local.paged_attention import reference
from grpo.sampling.local.static_sampler import StaticSampler
from paged_cases import long_tailed, ragged_slots
from processes import HELPERS, ROOT
from tiny_decoders import EOS, PAD, fp32_gap, greedy_reference

pytestmark = pytest.mark.usefixtures("one_thread")  # one thread where numbers are compared (conftest)

TRITON = importlib.util.find_spec("triton") is not None


def dev_extra_installs_triton() -> bool:
    """Whether `pip install -e '.[dev]'` installs Triton on this platform: the marker on its line in the dev extra."""
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    triton = [r for r in map(Requirement, dev) if r.name == "triton"]
    assert triton, "pyproject.toml's dev extra no longer lists triton: these tests would never run"
    return triton[0].marker is None or triton[0].marker.evaluate()


def test_triton_is_installed_where_the_dev_extra_installs_it():
    # the kernel tests below skip without Triton, which would hide them on the platform they are meant to run on
    installs = dev_extra_installs_triton()
    if not TRITON and installs:
        pytest.fail("triton is missing: the dev extra installs it on this platform (pip install -e '.[dev]')",
                    pytrace=False)
    if not TRITON:
        pytest.skip("Triton is not installed, nor does the dev extra install it on this platform")


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """What interpreted_kernel.py wrote: the kernel's output and count on `ragged_slots`, and the sampler's runs."""
    if not TRITON:
        pytest.skip("Triton is not installed (the dev extra installs it on Linux x86-64)")
    out = tmp_path_factory.mktemp("interpreted") / "results.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(HELPERS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(HELPERS / "interpreted_kernel.py"), str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


def attention_by_hand(case: dict) -> torch.Tensor:
    """Each slot's attention over the positions it wrote ([0, plen) and [start, at], through its table), one slot
    at a time, in float64: [S, Hkv, G, D]; zeros for a slot that reads nothing."""
    q, k, v, page = case["q"].double(), case["k"].double(), case["v"].double(), case["page"]
    out = torch.zeros_like(q)
    for s in range(q.size(0)):
        at = int(case["at"][s])
        if at < 0:
            continue
        pos = list(range(int(case["plen"][s]))) + list(range(int(case["start"][s]), at + 1))
        flat = torch.tensor([int(case["table"][s, p // page]) * page + p % page for p in pos])
        scores = q[s] @ k[:, flat].transpose(1, 2) * case["scale"]  # [Hkv, G, n]
        out[s] = scores.softmax(-1) @ v[:, flat]  # [Hkv, G, D]
    return out


def test_the_kernel_attends_over_what_each_slot_wrote(interpreted):
    case, got = ragged_slots(), interpreted["kernel"]
    want = attention_by_hand(case)
    assert want.abs().max() > 0.5 and fp32_gap(got["out"], want) <= 1e-5
    assert fp32_gap(reference(*[case[n] for n in ("q", "k", "v", "table", "plen", "start", "at", "scale", "page")]),
                    want) <= 1e-5
    assert torch.equal(got["out"][5], torch.zeros_like(got["out"][5]))  # the free slot


def test_the_kernel_counts_the_positions_each_slot_wrote(interpreted):
    wrote = [29, 36, 66, 38, 17, 0]  # prefix and own tokens, slot by slot (ragged_slots' docstring)
    assert interpreted["kernel"]["read"].tolist() == wrote


def test_the_captured_layout_on_the_kernel_samples_the_eager_steps_tokens_through_refills_and_preemptions(
        interpreted):
    """4 slots for 8 rows and room for 6 pages: rows wait for slots and pages, and the newest are preempted and
    resumed from their prompt and the tokens they had chosen, all through the kernel; eager steps (rows kept
    from step to step) sample the same tokens and log-probs with every row in a slot and no budget."""
    run = interpreted["sampled"]["preempted"]
    model, ids, mask, s, u = long_tailed(24, lengths=(5, 11, 3, 7), repeat=2)
    want = StaticSampler(model).sample(ids, mask, s, EOS, PAD, streams=u)
    got_ids, got_mask, got_lp, got_truncated = run["sampled"]
    assert run["layout"] == "kernel" and not run["rows"] and run["preemptions"] >= 1
    assert torch.equal(got_ids, want.completion_ids) and torch.equal(got_mask, want.completion_mask)
    assert torch.equal(got_truncated, want.truncated) and fp32_gap(got_lp, want.logprobs) <= 1e-5
    assert got_mask.sum(1).max() > 16  # a row that took more than one page of its own
    assert run["pages_in_use"] == 0  # every page back after the call


def test_the_captured_layout_reads_what_the_rows_wrote_and_samples_a_full_forwards_greedy_tokens(interpreted):
    """Greedy on the kernel against greedy by a full forward over the whole sequence for every token (no cache), and
    the positions its attention read, counted where the kernel reads them, against what the rows wrote: each decode
    step of a row reads its prompt and the tokens it has so far, no more (not its pages' ends, not the budget)."""
    run = interpreted["sampled"]["greedy"]
    model, ids, mask, s, _ = long_tailed(20, temperature=0.0, lengths=(5, 2, 11), repeat=2)
    want_ids, want_mask, want_lp = greedy_reference(model, ids, mask, s.max_new_tokens)
    got_ids, got_mask, got_lp, _ = run["sampled"]
    assert torch.equal(got_ids, want_ids) and torch.equal(got_mask, want_mask)
    assert fp32_gap(got_lp, want_lp) <= 1e-5
    lengths = got_mask.sum(1)  # [B]
    assert lengths.min() < lengths.max() and lengths.max() > 16  # ragged, and past a page of the row's own
    # a row of p prompt tokens and c chosen: its first from the prefill, token j (1 <= j < c) from a decode step that
    # reads its p prompt positions and the j tokens before it
    wrote = sum((c - 1) * p + c * (c - 1) // 2 for p, c in zip(mask.sum(1).tolist(), lengths.tolist()))
    assert run["kv_positions_read"] == wrote
