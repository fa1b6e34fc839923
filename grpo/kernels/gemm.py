"""fp32 linears on this machine's faster GEMM library: MKL (torch's CPU default) or oneDNN.

A CPU build of torch runs an fp32 `F.linear` and its backward through MKL's sgemm. On AMD CPUs MKL takes its generic
AVX2 kernels whatever the CPU has, while oneDNN (in torch already, behind `torch.ops.mkldnn._linear_pointwise`) uses
the AVX-512 ones where they exist: measured 2.4x on an AMD EPYC with full-width AVX-512 at the GRPO step's shapes,
about even on an AVX2-only one, and little on Intel CPUs (where MKL uses AVX-512 too). Which is faster is a fact of
the machine, so it is measured, not assumed: `gemm_plan` times both libraries on the loop's own shapes, for each of
the three GEMMs of a linear layer (the forward `x W^T`, the input gradient `g W` and the weight gradient `g^T x`),
and keeps the faster of each. `fp32_gemm(model, plan)` then runs the model's plain fp32 linear layers through it.
Both libraries compute in fp32 and round as fp32 does (errors against fp64 of the same size): the choice moves
results by rounding only, which tests/grpo/kernels/test_gemm.py holds.

The oneDNN op is private. `onednn_problem()` checks it, at first use, on a small product against `F.linear`: a torch
whose op is missing or changed falls back to MKL with the reason said (under `auto`), or fails (`onednn` forced),
never slows or drifts unseen. bf16 and fp16 compute (autocast) already goes through oneDNN and is left alone.

The loops' setting is `fp32_gemm: auto | mkl | onednn` (SFT's `train`, GRPO's `grpo` sections; `auto` by default);
the plan and the rates measured are written to the loop's output folder (`gemm.json`), carried in each of its
checkpoints, and logged by the stage as parameters. A resumed run goes on with the plan it started with where it
runs on the same CPU (so it resumes to the bit, wherever its checkpoint was restored from), and measures again on
another (whose kernels round otherwise anyway). `auto` takes oneDNN for a GEMM only where it measures clearly
faster (`ONEDNN_MARGIN`): where the two are about even, the timing noise of a busy machine would otherwise pick
one library in one process and the other in the next.

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import contextlib
import functools
import json
import platform
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

F = torch.nn.functional
KINDS = ("forward", "input_grad", "weight_grad")  # the three GEMMs of a linear layer's forward and backward
LIBRARIES = ("mkl", "onednn")
PLAN_FILE = "gemm.json"
# oneDNN's rate over MKL's that `auto` needs to take oneDNN for a GEMM: 2.4x where MKL runs AVX2 kernels on a
# full-width AVX-512 CPU (Zen 5); 0.7-1.15x on an AVX2-only or an Intel CPU; 0.86-1.3x on Zen 4 (half-width
# AVX-512), GEMM by GEMM. Far from both, so that no run of one machine, quiet or busy, picks another plan than the
# last (at 1.15 a quiet AVX2 EPYC measured 1.149x, and load tipped its plan and every figure of the demo after it)
ONEDNN_MARGIN = 1.5
# the most elements of any operand the measurement makes (16 MiB in fp32): a GEMM larger than that is timed on a cut
# of it (fewer rows, fewer outputs), whose rate a library reaches on the whole as well. Timing Qwen2.5's
# 151,936-wide head whole made [tokens, 151936] operands, 2.4 GB more than the step it planned (whose chunked head
# never makes one)
PROBE_ELEMENTS = 2**22


class GemmPlan(NamedTuple):
    """Which library runs each of a linear layer's GEMMs, and what was measured to decide (GFLOP/s by
    "<kind>/<library>"; empty when the setting forced the choice)."""

    forward: str = "mkl"
    input_grad: str = "mkl"
    weight_grad: str = "mkl"
    rates: dict[str, float] = {}
    reason: str = "the default"
    setting: str = "mkl"  # the loop's `fp32_gemm` it was made for
    cpu: str = ""  # the CPU it was measured on (`cpu_model()`; empty where nothing was measured)

    def uses_onednn(self) -> bool:
        return "onednn" in (self.forward, self.input_grad, self.weight_grad)

    def params(self, section: str) -> dict[str, str]:
        """As the stage logs it: `<section>.fp32_gemm.<kind>` and the rates, one parameter each."""
        out = {f"{section}.fp32_gemm.{kind}": getattr(self, kind) for kind in KINDS}
        out[f"{section}.fp32_gemm.reason"] = self.reason
        if self.cpu:
            out[f"{section}.fp32_gemm.cpu"] = self.cpu
        out.update({f"{section}.fp32_gemm.gflops.{k}": f"{v:.1f}" for k, v in self.rates.items()})
        return out

    def save(self, folder: str | Path) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / PLAN_FILE).write_text(json.dumps(self._asdict()))


def load_plan(folder: str | Path) -> GemmPlan | None:
    """The plan a loop's output folder, or one of its checkpoints, holds (None: none, or one unreadable)."""
    path = Path(folder) / PLAN_FILE
    try:
        return GemmPlan(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):  # no file, or one cut short or of another version: measure again
        return None


def resumed_plan(held: GemmPlan | None, setting: str) -> GemmPlan | None:
    """The plan a resumed loop goes on with: the one it started with (`held`, from its folder or checkpoint) when
    made for the same setting and, where it was measured, on this CPU; else None, and it is made anew."""
    if held is None or held.setting != setting:
        return None
    return held if not held.rates or held.cpu == cpu_model() else None


@functools.cache
def cpu_model() -> str:
    """This CPU as its kernels are chosen: vendor, family and model, and its name (Linux's /proc/cpuinfo)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
            if not key.strip():  # the first processor's block is enough: every core is the same model
                break
    except OSError:
        return platform.machine() or "unknown"
    if "cpu family" not in fields:
        return fields.get("model name") or platform.machine() or "unknown"
    return (f"{fields.get('vendor_id', '')} family {fields['cpu family']} model {fields.get('model', '?')} "
            f"({fields.get('model name', '')})")


# -- the private op, checked -------------------------------------------------------------------------------------------

def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] times weight [N, K] transposed (+ bias [N]) through oneDNN; strided views are read as they are."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.cache
def onednn_problem() -> str | None:
    """Why oneDNN's linear cannot be used in this torch (None: it can): the op must exist and give `F.linear`'s
    product, its input-gradient and weight-gradient forms included, within fp32 rounding."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return f"torch {torch.__version__} has no torch.ops.mkldnn._linear_pointwise"
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(s, generator=gen) for s in ((37, 24), (19, 24), (19,)))
    g = torch.randn(37, 19, generator=gen)
    try:
        got = [_onednn_linear(x, w, b), _onednn_linear(g, w.t(), None), _onednn_linear(g.t(), x.t(), None)]
    except Exception as e:  # noqa: BLE001 (any failure of a private op is the answer)
        return f"torch.ops.mkldnn._linear_pointwise failed on a small product: {type(e).__name__}: {e}"
    want = [F.linear(x, w, b), g @ w, g.t() @ x]
    for kind, a, e in zip(KINDS, got, want):
        if a.shape != e.shape or not torch.allclose(a, e, rtol=1e-5, atol=1e-5):
            return f"torch.ops.mkldnn._linear_pointwise gives another {kind} product than F.linear's"
    return None


# -- the autograd function ----------------------------------------------------------------------------------------------

class PlannedLinear(torch.autograd.Function):
    """F.linear of a [M, K] input with each of its three GEMMs on the library the plan names.

    2-D in, 2-D out: the caller reshapes around it, so the output is not a view made inside the Function (autograd
    forbids modifying such a view in place, and a logits hook does: `logits[..., ids] = -inf`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: GemmPlan):
        ctx.save_for_backward(x, weight)
        ctx.plan, ctx.has_bias = plan, bias is not None
        return _onednn_linear(x, weight, bias) if plan.forward == "onednn" else F.linear(x, weight, bias)  # [M, N]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors  # [M, K], [N, K]
        plan = ctx.plan
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _onednn_linear(grad, weight.t(), None) if plan.input_grad == "onednn" else grad @ weight  # [M, K]
        if ctx.needs_input_grad[1]:
            grad_w = _onednn_linear(grad.t(), x.t(), None) if plan.weight_grad == "onednn" else grad.t() @ x  # [N, K]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.sum(0)  # [N]
        return grad_x, grad_w, grad_b, None


def planned_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: GemmPlan) -> torch.Tensor:
    """F.linear(x, weight, bias) for an input of any leading shape, its GEMMs where `plan` says."""
    y = PlannedLinear.apply(x.reshape(-1, x.size(-1)), weight, bias, plan)  # [M, N]
    return y.view(*x.shape[:-1], weight.size(0))


def _plain_fp32(module: torch.nn.Module) -> bool:
    return (type(module) is torch.nn.Linear and module.weight.dtype == torch.float32
            and module.weight.device.type == "cpu" and "forward" not in vars(module))


def _planned_forward(module: torch.nn.Linear, plan: GemmPlan):
    def forward(x: torch.Tensor) -> torch.Tensor:
        w = module.weight
        if (x.dtype != torch.float32 or torch.is_autocast_enabled("cpu") or not isinstance(w, torch.Tensor)
                or type(w).__name__ == "DTensor"):
            return F.linear(x, w, module.bias)  # autocast's bf16 is oneDNN's already; a sharded weight is FSDP's
        return planned_linear(x, w, module.bias, plan)

    forward.gemm_plan = plan  # what `is_planned` reads: the layer is still a plain linear, on another library
    return forward


def is_planned(module: torch.nn.Module) -> bool:
    """Whether the module's own forward is `fp32_gemm`'s: F.linear on the planned library, no other change (so an
    output head under it is still one whose log-probs may be computed chunk by chunk from the hidden states)."""
    return getattr(vars(module).get("forward"), "gemm_plan", None) is not None


@contextlib.contextmanager
def fp32_gemm(model: torch.nn.Module | None, plan: GemmPlan | None) -> Iterator[None]:
    """Within the block, the model's plain fp32 CPU linear layers run their GEMMs as `plan` says; their own forward
    is restored after. Nothing changes where the plan is MKL's throughout (torch's default path)."""
    patched = []
    if model is not None and plan is not None and plan.uses_onednn():
        for module in model.modules():
            if _plain_fp32(module):
                module.forward = _planned_forward(module, plan)
                patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward


# -- measuring ------------------------------------------------------------------------------------------------------------

def linear_shapes(model: torch.nn.Module, tokens: int) -> list[tuple[int, int, int]]:
    """(M, K, N) of the model's distinct fp32 linear layers at `tokens` rows a micro-batch."""
    return sorted({(tokens, m.in_features, m.out_features) for m in model.modules() if _plain_fp32(m)})


def _cpu_seconds(fn) -> float:
    """The CPU time this thread spent in `fn()`: on one thread, time the machine's other processes took from it
    (a busy machine's preemptions) is not counted, as wall time would count it."""
    start = time.thread_time()
    fn()
    return time.thread_time() - start


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def probe_shape(M: int, K: int, N: int) -> tuple[int, int, int]:
    """(M, K, N) cut so that no operand of its three GEMMs (x [M, K], W [N, K], g [M, N]) passes PROBE_ELEMENTS."""
    n = max(1, min(N, PROBE_ELEMENTS // K, PROBE_ELEMENTS // M))
    m = max(1, min(M, PROBE_ELEMENTS // K, PROBE_ELEMENTS // n))
    return m, K, n


def measure(shapes: Sequence[tuple[int, int, int]], reps: int = 5) -> dict[str, float]:
    """GFLOP/s a core of each GEMM kind on each library over `shapes`, each cut to `probe_shape` (the best of
    `reps` runs, summed over the shapes).

    Made to give one answer on a quiet machine and a busy one: on one thread, timed in that thread's CPU time (a
    preemption is not counted), the two libraries in turns (a burst of load hits both). Timed on all threads in
    wall time, as it once was, one busy 2-core machine measured oneDNN at 0.4x to 5.3x MKL's rate on one shape set
    from one run to the next. A library faster on one core is the faster on each core of several."""
    seconds = {f"{kind}/{lib}": 0.0 for kind in KINDS for lib in LIBRARIES}
    flops = 0.0
    gen = torch.Generator().manual_seed(0)
    with _one_thread():
        for M, K, N in sorted({probe_shape(*shape) for shape in shapes}):
            x, w = torch.randn(M, K, generator=gen), torch.randn(N, K, generator=gen)
            g = torch.randn(M, N, generator=gen)
            runs = {"forward/mkl": lambda: F.linear(x, w), "forward/onednn": lambda: _onednn_linear(x, w, None),
                    "input_grad/mkl": lambda: g @ w, "input_grad/onednn": lambda: _onednn_linear(g, w.t(), None),
                    "weight_grad/mkl": lambda: g.t() @ x,
                    "weight_grad/onednn": lambda: _onednn_linear(g.t(), x.t(), None)}
            for fn in runs.values():
                fn()  # warm: first calls allocate and pick kernels
            best = {key: float("inf") for key in runs}
            for _ in range(reps):  # in turns
                for key, fn in runs.items():
                    best[key] = min(best[key], _cpu_seconds(fn))
            for key in runs:
                seconds[key] += best[key]
            flops += 2.0 * M * K * N
    return {key: flops / max(s, 1e-9) / 1e9 for key, s in seconds.items()}


def gemm_plan(setting: str, shapes: Sequence[tuple[int, int, int]]) -> GemmPlan:
    """The plan for `fp32_gemm: setting` ("auto", "mkl" or "onednn") on these shapes. Measured once a process for
    a given set of shapes: two loops of one process on the same model run the same kernels, so their numbers agree
    to the bit where they would without the plan (a resumed run keeps the plan it started with: `resumed_plan`)."""
    return _gemm_plan(setting, tuple(sorted(set(shapes))))


@functools.cache
def _gemm_plan(setting: str, shapes: tuple[tuple[int, int, int], ...]) -> GemmPlan:
    if setting == "mkl":
        return GemmPlan(reason="fp32_gemm: mkl", setting=setting)
    problem = onednn_problem()
    if setting == "onednn":
        if problem:
            raise RuntimeError(f"fp32_gemm: onednn cannot be used here: {problem}; set fp32_gemm to auto or mkl")
        return GemmPlan("onednn", "onednn", "onednn", reason="fp32_gemm: onednn", setting=setting)
    if setting != "auto":
        raise ValueError(f"fp32_gemm must be auto, mkl or onednn, got {setting!r}")
    if problem:
        return GemmPlan(reason=f"auto: MKL, since {problem}", setting=setting)
    if not shapes:
        return GemmPlan(reason="auto: no fp32 linear layer to measure", setting=setting)
    rates = measure(shapes)
    picks = {kind: "onednn" if rates[f"{kind}/onednn"] >= ONEDNN_MARGIN * rates[f"{kind}/mkl"] else "mkl"
             for kind in KINDS}
    return GemmPlan(**picks, rates=rates, setting=setting, cpu=cpu_model(),
                    reason=f"auto: measured on the loop's shapes, oneDNN where {ONEDNN_MARGIN}x MKL's rate or more")


def loop_plan(setting: str, model: torch.nn.Module, tokens: int, precision: str, device_type: str) -> GemmPlan:
    """A training loop's plan: measured (or forced) where it computes in fp32 on a CPU, torch's own path elsewhere."""
    if device_type != "cpu" or precision != "no":
        return GemmPlan(reason=f"not an fp32 CPU loop ({precision} on {device_type}): torch's own path",
                        setting=setting)
    return gemm_plan(setting, linear_shapes(model, tokens))


# -- the sampler's packed linears --------------------------------------------------------------------------------------
# A sampler packs each weight once a generate call for the batch's rows and then runs the same small-M product at
# every decode step. Both libraries can pack: MKL (`torch.ops.mkl._mkl_reorder_linear_weight`) and oneDNN
# (`torch.ops.mkldnn._reorder_linear_weight`). At an output layer as wide as a real vocabulary, oneDNN's packed
# product ran 2.0-2.6x MKL's on a Zen 4 (AVX-512) with 32 rows ([32, 256] x [256, 151936]: 16-17 ms against 33-44
# ms on two threads; 1.65-1.78x on one), and at rows fewer than it was packed for, MKL's packed GEMM slowed further
# (22-44 ms) where oneDNN's did not (7-11 ms). At the layers' shapes of a small model the two were within 1.1-1.2x
# on one thread. So it is measured, in turns and against `ONEDNN_MARGIN` as the loops' plan is (on the sampler's
# threads: `measure_packed`), shape by shape, and only for weights large enough that a decode step's call is not a
# few microseconds of fixed cost (`PACKED_MEASURE_ELEMENTS`): below that MKL's packed path is kept unmeasured.
PACKED_MEASURE_ELEMENTS = 2**20  # a weight of fewer elements (4 MiB in fp32) keeps MKL's packing unmeasured


def _mkl_packed_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def _onednn_packed_available() -> bool:
    return onednn_packed_problem() is None


@functools.cache
def onednn_packed_problem() -> str | None:
    """Why oneDNN's packed linear cannot be used in this torch (None: it can): the ops must exist and give
    `F.linear`'s product within fp32 rounding, at the rows packed for and at fewer."""
    problem = onednn_problem()
    if problem:
        return problem
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return f"torch {torch.__version__} has no torch.ops.mkldnn._reorder_linear_weight"
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(s, generator=gen) for s in ((37, 24), (19, 24), (19,)))
    try:
        packed = pack_weight(w, 37, "onednn")
        got = [packed_product(x, packed, w, b, 37, "onednn"), packed_product(x[:5], packed, w, b, 37, "onednn")]
    except Exception as e:  # noqa: BLE001 (any failure of a private op is the answer)
        return f"oneDNN's packed linear failed on a small product: {type(e).__name__}: {e}"
    for a, e in zip(got, [F.linear(x, w, b), F.linear(x[:5], w, b)]):
        if a.shape != e.shape or not torch.allclose(a, e, rtol=1e-5, atol=1e-5):
            return "oneDNN's packed linear gives another product than F.linear's"
    return None


def pack_weight(weight: torch.Tensor, rows: int, library: str) -> torch.Tensor:
    """`weight` [N, K] packed for products of about `rows` rows by `library` ("mkl" or "onednn")."""
    if library == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows)


def packed_product(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   rows: int, library: str) -> torch.Tensor:
    """x [M, K] times the packed weight [N, K] transposed (+ bias [N]): [M, N], any M."""
    if library == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)


def packed_library(setting: str, rows: int, K: int, N: int) -> str | None:
    """Which library packs a sampler's fp32 CPU linear of weight [N, K] for `rows` rows: "mkl", "onednn", or None
    where this torch has neither packed GEMM (then F.linear). `setting` is the loop's `fp32_gemm` ("auto" where
    the caller has none): "mkl" keeps MKL's packing (the sampler as before, bit for bit), "onednn" takes oneDNN's,
    "auto" measures (above). Measured once a process for a shape, so every call of one process packs alike."""
    return _packed_library(setting, rows, K, N)


@functools.cache
def _packed_library(setting: str, rows: int, K: int, N: int) -> str | None:
    if setting not in ("auto", "mkl", "onednn"):
        raise ValueError(f"fp32_gemm must be auto, mkl or onednn, got {setting!r}")
    mkl = "mkl" if _mkl_packed_available() else None
    if setting == "mkl":
        return mkl
    onednn = _onednn_packed_available()
    if setting == "onednn":
        if not onednn:
            raise RuntimeError(f"fp32_gemm: onednn cannot pack the sampler's weights here: "
                               f"{onednn_packed_problem()}; set fp32_gemm to auto or mkl")
        return "onednn"
    if not onednn or mkl is None or N * K < PACKED_MEASURE_ELEMENTS:
        return mkl
    rates = measure_packed(rows, K, N)
    return "onednn" if rates["onednn"] >= ONEDNN_MARGIN * rates["mkl"] else "mkl"


def measure_packed(rows: int, K: int, N: int, reps: int = 7) -> dict[str, float]:
    """GFLOP/s of the packed product [rows, K] x [K, N] on each library, on the threads the sampler runs with: the
    shape cut to `probe_shape`, the libraries in turns, the fastest of `reps` runs each (a busy moment only adds
    time, so the fastest run is the machine's rate). Not on one thread, as `measure` times the loops' GEMMs: MKL's
    packed product gains little from a second thread at a decode step's few rows where oneDNN's nearly doubles
    (the wide head: 1.55-1.8x on one thread, 2.0-2.6x on two), and the sampler runs on all of them."""
    M, K, N = probe_shape(rows, K, N)
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(M, K, generator=gen), torch.randn(N, K, generator=gen)
    packed = {lib: pack_weight(w, M, lib) for lib in LIBRARIES}
    runs = {lib: (lambda lib=lib: packed_product(x, packed[lib], w, None, M, lib)) for lib in LIBRARIES}
    for fn in runs.values():
        fn()  # warm: first calls allocate and pick kernels
    best = {lib: float("inf") for lib in LIBRARIES}
    for _ in range(reps):  # in turns
        for lib, fn in runs.items():
            start = time.perf_counter()
            fn()
            best[lib] = min(best[lib], time.perf_counter() - start)
    return {lib: 2.0 * M * K * N / max(s, 1e-9) / 1e9 for lib, s in best.items()}
