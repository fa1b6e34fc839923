"""How the training processes hold a model: the one place that turns a model and its optimizer into their
distributed form (`distributed.strategy` in a stage's recipe section) and gathers whole weights back.

Every training loop (SFT, GRPO, the reward model) asks `make_strategy` once and then calls the same few methods,
whatever the strategy; none branches on it:

| call | `ddp` (and one process) | `fsdp` |
|---|---|---|
| `prepare(model, optimizer, scheduler)` | accelerate's `prepare`: DDP across processes | FSDP2 (`fully_shard`): one unit per decoder layer, then the root; the optimizer steps the shards |
| `prepare(...)` again (PPO's critic) | the same, beside the first | the same; the checkpoints hold both models and both optimizers |
| `accumulate(model)` | accelerate's: DDP's `no_sync` but on the last micro-batch | the same, through FSDP2's `set_requires_gradient_sync` |
| `no_sync(model, last)` | DDP's `no_sync` unless `last` | FSDP2's gradient sync off unless `last` |
| `whole_model(model)` | the model itself | a plain copy holding the whole fp32 weights, on the main process (None elsewhere) |
| `sampler_model(dtype)`, `sync_sampler()` | the policy itself; nothing to sync | a whole copy in the sampling dtype, gathered into one unit at a time |
| `save_state(folder)`, `load_state(folder)` | accelerate's `save_state` / `load_state` | `torch.distributed.checkpoint` shards: loads on any process count |

FSDP2 keeps 1/N of the weights, gradients and AdamW state on each of N processes (16 bytes a parameter / N in fp32
with AdamW, against 16 for DDP) and gathers one unit's weights while it computes. Where the loop computes in bf16
the units compute and all-gather in bf16 and reduce gradients in fp32, and AdamW steps fp32 shards: the role
`MasterWeights` plays for `weights_dtype: bfloat16` in one process, so that setting and 8-bit AdamW are refused
with fsdp (`check_fsdp_settings`). With one process there is nothing to shard: the model trains as under `ddp`,
and only the checkpoints are sharded ones, so a stage killed on one process resumes on two and the other way round.

GRPO samples from whole weights (a sharded forward is a collective that every process would have to run in step,
while each samples its own prompts to its own lengths): the sampler's copy is the one whole copy of the policy on
each process (with the KV cache, the only whole-model memory), refreshed after every optimizer step one weight at
a time, never the whole model in fp32 at once. The frozen reference stays whole too (see `GRPOTrainer`). Every
gather is a collective under the process group's timeout (`distributed.collective_timeout_s`).

The first model prepared is the policy: the one the sampler reads and the final checkpoint saves. A loop that
trains a second model beside it (PPO's critic) prepares it after the policy with its own optimizer and scheduler;
each is sharded, stepped and checkpointed on its own, and both resume on any process count.

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator

from grpo.configs.distributed import DistributedConfig, FSDPConfig

SCHEDULER_FILE = "scheduler.pt"
STRATEGY_FILE = "strategy.json"  # which strategy wrote a checkpoint folder, and on how many processes


def make_strategy(acc: Accelerator, distributed: DistributedConfig | None = None) -> "Strategy":
    """The strategy the stage's `distributed` section names, for the processes `acc` runs on."""
    distributed = distributed or DistributedConfig()
    if distributed.strategy == "fsdp":
        return FSDPStrategy(acc, distributed.fsdp)
    return Strategy(acc)


class Strategy:
    """Whole weights on every process, gradients averaged by DDP (accelerate's own preparation)."""

    name = "ddp"

    def __init__(self, acc: Accelerator):
        self.acc = acc
        self._policy: torch.nn.Module | None = None

    # -- the model in its distributed form ---------------------------------------------------------------------

    def prepare(self, model: torch.nn.Module, optimizer=None, scheduler=None):
        """The model (and its optimizer and scheduler) ready to train across the processes."""
        prepared = self.acc.prepare(*[x for x in (model, optimizer, scheduler) if x is not None])
        prepared = prepared if isinstance(prepared, tuple) else (prepared,)
        if self._policy is None:  # the first model prepared is the policy (the sampler's, the final checkpoint's)
            self._policy = self.acc.unwrap_model(prepared[0])
        return prepared if len(prepared) > 1 else prepared[0]

    def accumulate(self, model: torch.nn.Module):
        """One micro-batch of an optimizer step (`grad_accum_steps`); gradients sync in the last one only."""
        return self.acc.accumulate(model)

    def no_sync(self, model: torch.nn.Module, last: bool):
        """One micro-batch's forward and backward, gradients synced across processes only in the `last` one."""
        return self.acc.no_sync(model) if not last else contextlib.nullcontext()

    # -- whole weights back --------------------------------------------------------------------------------------

    def whole_model(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """The trained model with its whole weights, for the final checkpoint (call on every process): the model
        itself here; under fsdp a plain copy on the main process and None elsewhere."""
        return self.acc.unwrap_model(model)

    def sampler_model(self, dtype: torch.dtype | None = None) -> torch.nn.Module:
        """The module the sampler reads: the policy itself (its engine makes any `dtype` copy it needs)."""
        return self._policy

    def sync_sampler(self) -> None:
        """Make `sampler_model` hold the policy's current weights (nothing to do: it is the policy)."""

    def check_sampler(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor,
                      temperature: float) -> dict[str, float]:
        """The sampler's copy against the policy on a few rows (`FSDPStrategy`); none here: it is the policy."""
        return {}

    # -- resume checkpoints ----------------------------------------------------------------------------------------

    def save_state(self, folder: Path) -> None:
        """Weights, optimizer, scheduler and RNG state into `folder` (every process calls it)."""
        # tied embeddings trip safetensors' shared-memory check
        self.acc.save_state(str(folder), safe_serialization=False)
        self._record(folder)

    def load_state(self, folder: Path) -> None:
        self._check_format(folder)
        self.acc.load_state(str(folder))

    def _record(self, folder: Path) -> None:
        if self.acc.is_main_process:
            (Path(folder) / STRATEGY_FILE).write_text(json.dumps({"strategy": self.name,
                                                                  "processes": self.acc.num_processes}))

    def _check_format(self, folder: Path) -> None:
        """Refuse a checkpoint this strategy cannot read, in one line, before anything is loaded."""
        written = _written_by(folder)
        if written is None:
            return  # written before checkpoints recorded their strategy: accelerate's own format
        if written["strategy"] != self.name:
            raise ValueError(f"{folder}: a {written['strategy']} checkpoint cannot be resumed with "
                             f"distributed.strategy {self.name}; set the strategy it was written with")


class FSDPStrategy(Strategy):
    """FSDP2: each process holds 1/N of every weight, gradient and optimizer state (see the module docstring)."""

    name = "fsdp"

    def __init__(self, acc: Accelerator, cfg: FSDPConfig):
        super().__init__(acc)
        self.cfg = cfg
        self.sharded = acc.num_processes > 1  # one process: nothing to shard, plain training
        self._skeleton: torch.nn.Module | None = None  # the model's structure with meta weights
        self._sampler: torch.nn.Module | None = None
        self._synced_frozen = False  # frozen weights (LoRA's base) are gathered once, at the first sync
        # what each `prepare` gave, in order: (model, optimizer, scheduler); the first is the policy
        self._held: list[tuple[torch.nn.Module, object, object]] = []

    @property
    def _model(self) -> torch.nn.Module | None:
        return self._held[0][0] if self._held else None

    def prepare(self, model: torch.nn.Module, optimizer=None, scheduler=None):
        if self.sharded:
            if not self._held:  # the structure the policy's whole copies (sampler, final weights) are made in
                self._skeleton = _meta_copy(model)
            names = {id(p): n for n, p in model.named_parameters()}
            model = self._shard(model)
            if optimizer is not None:
                _follow_parameters(optimizer, names, dict(model.named_parameters()))
            rest = [x for x in (optimizer, scheduler) if x is not None]
            if rest:
                prepared = self.acc.prepare(*rest)  # accelerate's wrappers skip steps on accumulating micro-batches
                rest = list(prepared) if isinstance(prepared, tuple) else [prepared]
            out = (model, *rest)
        else:
            out = super().prepare(model, optimizer, scheduler)
            out = out if isinstance(out, tuple) else (out,)
        if not self._held:
            self._policy = self.acc.unwrap_model(out[0])
        self._held.append((out[0], out[1] if optimizer is not None else None, out[-1] if scheduler is not None else None))
        return out if len(out) > 1 else out[0]

    def _shard(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.acc.device.type, (self.acc.num_processes,))
        kwargs = {"mesh": mesh, "reshard_after_forward": self.cfg.reshard_after_forward}
        if self.acc.mixed_precision == "bf16":  # bf16 compute and all-gathers, fp32 gradient reduction
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if self.cfg.cpu_offload and self.acc.device.type == "cuda":
            kwargs["offload_policy"] = CPUOffloadPolicy()
        units = decoder_layers(model)
        for layer in units:
            fully_shard(layer, **kwargs)
        # the root keeps its own weights (embeddings, final norm, head) gathered from its forward to its backward
        fully_shard(model, **{**kwargs, "reshard_after_forward": False})
        return model

    def accumulate(self, model: torch.nn.Module):
        return self._accumulate(model) if self.sharded else super().accumulate(model)

    @contextlib.contextmanager
    def _accumulate(self, model: torch.nn.Module):
        with self.acc.accumulate(model):  # decides whether this micro-batch is the step's last (sync_gradients)
            model.set_requires_gradient_sync(self.acc.sync_gradients)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module, last: bool):
        if not self.sharded:
            with super().no_sync(model, last):
                yield
            return
        model.set_requires_gradient_sync(last)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def whole_model(self, model: torch.nn.Module) -> torch.nn.Module | None:
        if not self.sharded:
            return super().whole_model(model)
        if model is not self._model:
            raise ValueError("whole_model gathers the policy (the first model prepared), not another")
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # every process joins the gathers; the main one receives the whole fp32 weights in CPU memory
        weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.acc.is_main_process:
            return None
        whole = self._skeleton
        whole.load_state_dict(weights, assign=True)
        if hasattr(whole, "tie_weights"):
            whole.tie_weights()  # assign loads a tied weight's two names as two tensors: one again
        return whole.to("cpu")

    def sampler_model(self, dtype: torch.dtype | None = None) -> torch.nn.Module:
        if not self.sharded:
            return super().sampler_model(dtype)
        if self._sampler is None:
            device = self.acc.device
            made = {id(p): torch.nn.Parameter(torch.empty(p.shape, dtype=dtype or p.dtype, device=device),
                                              requires_grad=False)
                    for p in self._skeleton.parameters()}
            self._sampler = copy.deepcopy(self._skeleton, made).to(device).eval()
            self._synced_frozen = False
            self.sync_sampler()
        return self._sampler

    def check_sampler(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor,
                      temperature: float) -> dict[str, float]:
        """`sync/logprob_gap`: the mean absolute gap, in nats a token, between the sampler's copy and the sharded
        policy on the completion tokens of these rows (a few of the step's); a gap far above the precision's
        rounding stops the stage, since a copy gathered wrong samples from another policy while every step looks
        normal. Every process calls it once a step (the sharded forward is a collective)."""
        if not self.sharded or self._sampler is None:
            return {}
        from grpo.training.logprobs import token_logps

        C = completion_mask.size(1)
        was_training = self._model.training
        self._model.eval()
        try:
            with torch.no_grad(), self.acc.autocast():
                mine = token_logps(self._sampler, input_ids, attention_mask, C, temperature)[0]  # [n, C]
                theirs = token_logps(self._model, input_ids, attention_mask, C, temperature)[0]  # [n, C]
        finally:
            self._model.train(was_training)
        mask = completion_mask.float()
        gap = float(((mine - theirs).abs() * mask).sum() / mask.sum().clamp(min=1))
        limit = self.cfg.max_sync_logprob_gap or (1e-3 if self.acc.mixed_precision == "no" else 0.1)
        if not gap <= limit:  # NaN too
            raise RuntimeError(f"the sampler's gathered weights disagree with the sharded policy: mean log-prob gap "
                               f"{gap:.4g} nats a token on the same tokens, above distributed.fsdp."
                               f"max_sync_logprob_gap={limit:g}; the weight sync is broken, stopping before it "
                               f"trains on samples from another policy")
        return {"sync/logprob_gap": gap}

    @torch.no_grad()
    def sync_sampler(self) -> None:
        """Gather the policy's weights into the sampler's copy one FSDP unit at a time (a decoder layer, then the
        root's own weights: one all-gather each, in the same order on every process), so the whole weights alive
        beside the shards are one unit's, never the model's."""
        if not self.sharded or self._sampler is None:
            return
        from torch.distributed.fsdp import FSDPModule

        targets = dict(self._sampler.named_parameters())
        units = [(prefix, m) for prefix, m in self._model.named_modules() if isinstance(m, FSDPModule)]
        inner = {id(p) for prefix, m in units if prefix for p in m.parameters()}  # the layers' (not the root's own)
        for prefix, unit in units:  # every process in the same order: each unit's one all-gather is a collective
            own = [n for n, p in unit.named_parameters(prefix=prefix)
                   if (prefix or id(p) not in inner) and (p.requires_grad or not self._synced_frozen)]
            if not own:
                continue  # frozen (LoRA's base) and already copied
            unit.unshard()  # the unit's whole weights (in the compute dtype) take the shards' place until reshard
            try:
                whole = dict(unit.named_parameters(prefix=prefix))
                for name in own:
                    targets[name].copy_(whole[name])
            finally:
                unit.reshard()
        self._synced_frozen = True

    def save_state(self, folder: Path) -> None:
        import torch.distributed.checkpoint as dcp

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        dcp.save(self._state(), checkpoint_id=str(folder))  # each process writes its shards; metadata last
        for i, (_, _, scheduler) in enumerate(self._held):
            if self.acc.is_main_process and scheduler is not None:
                torch.save(scheduler.state_dict(), folder / _scheduler_file(i))
        torch.save(_rng_state(), folder / f"rng-{self.acc.process_index}.pt")
        self._record(folder)

    def load_state(self, folder: Path) -> None:
        folder = Path(folder)
        written = _written_by(folder)
        if written is None or written["strategy"] != self.name:
            raise ValueError(f"{folder}: a {written['strategy'] if written else 'ddp'} checkpoint cannot be resumed "
                             f"with distributed.strategy fsdp; set the strategy it was written with")
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        state = self._state()
        # the shards are read by what each process holds now, so a checkpoint of N processes loads on M
        dcp.load(state, checkpoint_id=str(folder), no_dist=not self.sharded)
        for i, (model, optimizer, scheduler) in enumerate(self._held):
            key = _state_key(i)
            if optimizer is not None:
                set_state_dict(model, [_inner(optimizer)], model_state_dict=state[f"model{key}"],
                               optim_state_dict=state[f"optim{key}"])
            else:
                set_model_state_dict(model, state[f"model{key}"])
            if scheduler is not None and (folder / _scheduler_file(i)).exists():
                scheduler.load_state_dict(torch.load(folder / _scheduler_file(i), weights_only=False))
        mine = folder / f"rng-{self.acc.process_index}.pt"
        if mine.exists():  # a process the checkpoint did not have draws anew (the loops reseed by step anyway)
            _set_rng_state(torch.load(mine, weights_only=False))

    def _state(self) -> dict:
        """Every prepared model's (and optimizer's) state: `model`/`optim` for the policy, `model_1`/`optim_1` for
        the model prepared after it."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        state = {}
        for i, (model, optimizer, _) in enumerate(self._held):
            key = _state_key(i)
            if optimizer is None:
                state[f"model{key}"] = get_model_state_dict(model)
            else:
                state[f"model{key}"], state[f"optim{key}"] = get_state_dict(model, [_inner(optimizer)])
        return state


def _state_key(i: int) -> str:
    return f"_{i}" if i else ""


def _scheduler_file(i: int) -> str:
    return SCHEDULER_FILE if not i else f"scheduler-{i}.pt"


def _inner(optimizer):
    """The torch optimizer inside accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks, each one FSDP unit: the classes its transformers model names as not to be split
    (`_no_split_modules`: Qwen2DecoderLayer, LlamaDecoderLayer, ...)."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"distributed.strategy fsdp: no decoder layer found in this {type(model).__name__} "
                         f"(its transformers class names none in _no_split_modules); use strategy ddp")
    return layers


def _meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The model's structure with every parameter on the meta device (no memory), buffers as they are."""
    made = {id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in model.parameters()}
    return copy.deepcopy(model, made)


def _follow_parameters(optimizer, names: dict[int, str], sharded: dict[str, torch.nn.Parameter]) -> None:
    """Point an optimizer built over the whole parameters at their shards (it has taken no step yet)."""
    for group in optimizer.param_groups:
        group["params"] = [sharded[names[id(p)]] for p in group["params"]]


def _written_by(folder: Path) -> dict | None:
    path = Path(folder) / STRATEGY_FILE
    return json.loads(path.read_text()) if path.exists() else None


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
