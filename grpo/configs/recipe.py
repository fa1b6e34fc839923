"""The recipe: one frozen config object per stage, and reading a recipe file.

Each stage config is at once the stage flow's Prefect parameter (the UI renders it as a form), a section of a
recipe YAML file, and the params logged on the stage's MLflow run; its parts are the settings in the modules beside it.
Defaults are the `tiny` recipe's values. A recipe read from a file can take overrides of any of its fields (dotted
paths to values, as the pipeline deployment's form and `r1 run --set` give them), checked like the file was.
Plain pydantic: must not import torch, transformers or the modules that do the work, so a recipe is read and
checked in well under a second.
"""

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from grpo.configs.alignment import AlignmentEvalConfig, AlignmentWatchConfig
from grpo.configs.budget import BudgetConfig
from grpo.configs.checks import (also_known, check_fits_context, check_fsdp_settings, check_process_split,
                                 check_prompts_per_step, describe_errors, fields_at, model_at, sectioned,
                                 unmoved_path, warn_flat_names)
from grpo.configs.data import DataConfig
from grpo.configs.distributed import DistributedConfig, rollout_ray_address
from grpo.configs.dpo import DPOConfig
from grpo.configs.grading import REWARD_MODEL, RULE_REWARDS, JudgeConfig
from grpo.configs.model import TINY, ModelConfig
from grpo.configs.ppo import PPOConfig, check_ppo_settings
from grpo.configs.rejection import ClusterConfig, RejectionConfig
from grpo.configs.reward import HARMLESSNESS, HELPFULNESS, REWARD_MODELS, PreferenceDataConfig, RewardModelConfig
from grpo.configs.rft import OnlineRFTConfig, check_rft_settings
from grpo.configs.rollout import check_async_rollout
from grpo.configs.sampling import EvalConfig, GenerationConfig, SamplingConfig
from grpo.configs.sweep import SweepConfig
from grpo.configs.training import GRPOConfig, SFTConfig

# Stage settings and the recipe


class ResourcesConfig(BaseModel):
    """Where a stage runs and what its flow run asks for: in the pipeline's own process by default, or, with a
    `pool`, as that pool's deployment of the stage (`r1 deploy` makes them), one flow run of its own.

    `gpus`, `cpus` and `memory` become the flow run's job variables `gpu_count`, `cpu` and `memory` (the names the
    Kubernetes template in deployments/ reads); `job_variables` adds any other variable of the pool's template.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    pool: str | None = None  # the work pool whose deployment `<stage>/<pool>` runs the stage; None: in process
    gpus: int = Field(0, ge=0)  # GPUs for the stage's flow run (job variable gpu_count); 0: the pool's default
    cpus: str | None = None  # CPU request, Kubernetes style ("8", "500m"); None: the pool's default
    memory: str | None = None  # memory request ("64Gi"); None: the pool's default
    job_variables: dict[str, Any] = Field(default_factory=dict)  # any other job variable of the pool's template
    # a stage that fails or whose machine is lost runs again this many times, each resuming from its last durable
    # checkpoint (placed: the pipeline starts a new flow run when the old one crashed or stopped beating)
    retries: int = Field(0, ge=0, le=20)
    retry_delays_s: list[float] = Field(default_factory=lambda: [30.0, 120.0, 600.0])  # before each retry; last repeats
    timeout_s: float | None = Field(None, gt=0)  # one attempt fails after this long (None: no limit)

    @field_validator("retry_delays_s")
    @classmethod
    def _delays(cls, delays: list[float]) -> list[float]:
        if not delays or any(not 0 <= d <= 86400 for d in delays):
            raise ValueError(f"expected one or more delays of 0 to 86400 seconds (got {delays})")
        return delays

    def retry_delay(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (0 for the first)."""
        return self.retry_delays_s[min(retry, len(self.retry_delays_s) - 1)]

    def as_job_variables(self) -> dict[str, Any]:
        """The flow run's job variables: what this section sets, nothing the pool's defaults already give."""
        given = {"gpu_count": self.gpus or None, "cpu": self.cpus, "memory": self.memory}
        return {**self.job_variables, **{k: v for k, v in given.items() if v is not None}}


class PoolConfig(BaseModel):
    """What one flow run on a work pool can be given, as the team that runs the pool declares it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpus: int = Field(0, ge=0)  # the most GPUs one flow run on this pool can have (a node's count)


class StageConfig(BaseModel):
    """What every stage's settings have: where it runs, and the global batches its processes share."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)  # its work pool and what it asks for
    # the engine that samples its rollouts, held-out completions and local judge (grpo.sampling.engines)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    text_engines: ClassVar[bool] = False  # whether a text-only engine (http) can serve it: rejection sampling only

    def process_batches(self) -> dict[str, int]:
        """Each global batch the stage's training processes split evenly (field -> size); none by default."""
        return {}

    def check_splits(self, processes: int | str | None = None) -> None:
        """Every global batch splits evenly across `processes` (default: the stage's own `distributed` count; a
        count known only where the stage runs, "auto", is checked there with the machine's)."""
        distributed = getattr(self, "distributed", None)
        n = processes if processes is not None else distributed.num_processes if distributed else 1
        if distributed is not None and isinstance(n, int):
            n *= distributed.num_machines  # the processes of every machine share each global batch
        for field, size in self.process_batches().items():
            check_process_split(field, size, n)

    @model_validator(mode="after")
    def _splits(self) -> "StageConfig":
        self.check_splits()
        if self.generation.backend == "http" and not self.text_engines:
            raise ValueError("generation.backend http serves text from a fixed checkpoint: only rejection sampling "
                             "can use it; this stage samples from the model it holds (local)")
        return self


class ColdStartSFTConfig(StageConfig):
    """Stage 1: supervised fine-tuning of the base model on a few thousand chain-of-thought rows."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelConfig = Field(default_factory=ModelConfig)  # the base model
    data: DataConfig = Field(default_factory=DataConfig)  # the cold-start rows (prompt, response)
    train: SFTConfig = Field(default_factory=SFTConfig)  # the training loop
    eval: EvalConfig = Field(default_factory=EvalConfig)  # held-out evaluation after training
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)  # processes the training runs on

    def process_batches(self) -> dict[str, int]:
        return {"train.batch_size": self.train.batch_size}


class ReasoningGRPOConfig(StageConfig):
    """Stage 2: GRPO from the cold-start checkpoint with rule rewards (accuracy, format, language)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelConfig = Field(default_factory=ModelConfig)  # loading options; the weights come from the checkpoint
    data: DataConfig = Field(default_factory=DataConfig)  # prompts with reference answers (prompt, answer)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)  # the GRPO loop and its rewards
    eval: EvalConfig = Field(default_factory=EvalConfig)  # held-out evaluation
    eval_before: bool = True  # also score the starting checkpoint (step 0), so the run shows what RL changed
    # "ppo": PPO with a critic as large as the policy instead (the baseline GRPO replaced), with `grpo`'s rewards,
    # sampling, KL and optimiser settings and `ppo`'s own
    # "online_rft": GRPO's sampler and loss, each sample's coefficient 1 if correct else 0 (grpo.training.rft)
    algorithm: Literal["grpo", "ppo", "online_rft"] = "grpo"
    ppo: PPOConfig = Field(default_factory=PPOConfig)  # read only with algorithm ppo
    online_rft: OnlineRFTConfig = Field(default_factory=OnlineRFTConfig)  # read only with algorithm online_rft
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)  # processes the training runs on

    def process_batches(self) -> dict[str, int]:
        return {"grpo.prompts_per_step": self.grpo.prompts_per_step}

    @model_validator(mode="after")
    def _check(self) -> "ReasoningGRPOConfig":
        self.grpo.check_rewards(set(RULE_REWARDS))  # no reward model in this stage: rule rewards only
        if self.grpo.grading.step_verifier == "arithmetic" and self.data.source != "synthetic":
            raise ValueError(f"grpo.grading.step_verifier 'arithmetic' reads the synthetic task's equations; "
                             f"data.source is {self.data.source!r}: use step_verifier 'gsm8k' for GSM8K-style "
                             f"solutions, or 'prm'")
        if self.algorithm == "ppo" and self.grpo.grading.supervision == "process":
            raise ValueError("grpo.grading.supervision 'process' is GRPO's step advantages; algorithm ppo takes the "
                             "outcome reward at each completion's last token: use supervision 'outcome' with ppo")
        check_fsdp_settings(self.distributed, weights_dtype=self.grpo.memory.weights_dtype,
                            optimizer=self.grpo.optimizer.name)
        check_async_rollout(self.grpo.rollout, engine=self.distributed.engine, algorithm=self.algorithm,
                            where="reasoning_grpo")
        self.check_prompts(self.data.num_train if self.data.source == "synthetic" else None)
        return self

    @model_validator(mode="after")
    def _check_online_rft(self) -> "ReasoningGRPOConfig":
        if self.algorithm == "online_rft":
            check_rft_settings(self.grpo, self.online_rft)
        return self

    def check_prompts(self, prompts: int | None, source: str = "the data section") -> None:
        """Raise if `prompts` training prompts (None: not known yet) cannot fill one step of the algorithm."""
        if self.algorithm == "ppo":
            check_ppo_settings(self.grpo, prompts, source)
        else:
            check_prompts_per_step(self.grpo.prompts_per_step, prompts, source)


class RejectionSamplingConfig(StageConfig):
    """Stage 3: many samples per prompt from the reasoning-RL checkpoint; keep the correct, readable ones."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    text_engines: ClassVar[bool] = True  # generation: the checkpoint here, or servers that serve it

    model: ModelConfig = Field(default_factory=ModelConfig)  # loading options; the weights come from the checkpoint
    data: DataConfig = Field(default_factory=DataConfig)  # prompts (answer where verifiable); held-out for decontam.
    rejection: RejectionConfig = Field(default_factory=RejectionConfig)  # samples, filters, shards, target
    # who checks rows the rule cannot (and, with judge_when="always", every row); None = rule check only.
    # model "checkpoint" = the checkpoint being sampled, asked in the judge prompt
    judge: JudgeConfig | None = None
    # non-reasoning rows: "synthetic", "model" (`model`'s own answers: grpo.rejection.non_reasoning) or a file like `data`
    non_reasoning_source: str = "synthetic"
    non_reasoning_sampling: SamplingConfig | None = None  # the "model" source's (None: rejection.sampling)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)  # threads here, or shard tasks on a Ray cluster
    budget: BudgetConfig = Field(default_factory=BudgetConfig)  # the plan printed first, then logged against the run


class SFTStageConfig(StageConfig):
    """Stage 4: SFT of the base model (not the RL model) on the curated rows."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelConfig = Field(default_factory=ModelConfig)  # the base model, as in stage 1
    train: SFTConfig = Field(default_factory=SFTConfig)  # the training loop
    eval: EvalConfig = Field(default_factory=EvalConfig)  # held-out evaluation after training
    # also train on the cold-start rows (R1 reuses parts of DeepSeek-V3's SFT data; a recipe whose curated set is
    # small keeps what stage 1 taught this way)
    include_cold_start: bool = False
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)  # processes the training runs on

    def process_batches(self) -> dict[str, int]:
        return {"train.batch_size": self.train.batch_size}


class AlignmentGRPOConfig(StageConfig):
    """Stage 5: GRPO for helpfulness and harmlessness (a reward model) on a mix that keeps reasoning prompts; or DPO."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelConfig = Field(default_factory=ModelConfig)  # loading options; the weights come from the checkpoint
    data: DataConfig = Field(default_factory=DataConfig)  # reasoning prompts with answers: rule rewards
    general_prompts: int = 200  # general (non-reasoning) prompts mixed in: scored by the reward model
    general_source: str = "synthetic"  # "synthetic" (generated requests, some harmful) or a file with `prompt`
    preferences: PreferenceDataConfig = Field(default_factory=PreferenceDataConfig)  # pairs the reward model learns
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig)  # trained in this stage...
    # a reward model's own optimizer steps by reward name, in place of reward_model.max_steps (harmlessness tells a
    # refusal from compliance in far fewer steps than helpfulness tells the right answer from an off-topic one)
    reward_model_steps: dict[str, Annotated[int, Field(ge=1)]] = Field(default_factory=dict)
    reward_model_uri: str | None = None  # ...unless this names an existing one (folder, runs:/ URI or hub name)
    # existing reward models by reward name (helpfulness, harmlessness, reward_model): folder, runs:/ URI or hub name;
    # a reward model grpo.rewards names and this does not is trained in the stage
    reward_model_uris: dict[str, str] = Field(default_factory=dict)
    # rewards by name: rule rewards for reasoning rows; "reward_model" (one scorer for every general prompt) or
    # "helpfulness" and "harmlessness" (one for each category, as R1) for general rows
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    watch: AlignmentWatchConfig = Field(default_factory=AlignmentWatchConfig)  # the true score beside the reward
    eval: EvalConfig = Field(default_factory=EvalConfig)  # held-out reasoning evaluation
    eval_before: bool = True  # also score the starting checkpoint, so the run shows what alignment cost or gained
    registered_model: str = "r1-tiny"  # MLflow registry name the final model is registered under
    alias: str = "champion"  # registry alias the new version may take (models:/<name>@<alias>)
    # when the alias moves to the new version: "auto" when its held-out accuracy is at least the holder's, "approve"
    # when a person says so in the Prefect UI (the flow waits), "always" on every run (r1 ... --promote)
    promotion: Literal["auto", "approve", "always"] = "auto"
    approval_timeout_s: int = Field(86400, ge=1)  # "approve": how long the flow waits for an answer
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)  # the reward model's and GRPO's (DPO's)
    # "dpo": DPO on the `preferences` pairs (grpo.training.loops.dpo) in place of the reward model and GRPO; general_*,
    # reward_model* and grpo are then not read (grpo.grading.code still sets the sandbox of held-out code rows)
    algorithm: Literal["grpo", "dpo"] = "grpo"
    dpo: DPOConfig = Field(default_factory=DPOConfig)  # read only with algorithm dpo
    # general prompts of known category answered greedily before and after training: harmful refused, benign helpful,
    # borderline over-refusal, handled right, each with its paired interval (grpo.evaluate.evaluate_alignment)
    alignment_eval: AlignmentEvalConfig = Field(default_factory=AlignmentEvalConfig)

    def reward_model_for(self, name: str) -> RewardModelConfig:
        """The training settings of the reward model `name`: reward_model, with its own steps where
        reward_model_steps names it."""
        steps = self.reward_model_steps.get(name)
        return self.reward_model if steps is None else self.reward_model.model_copy(update={"max_steps": steps})

    def process_batches(self) -> dict[str, int]:
        if self.algorithm == "dpo":
            return {"dpo.batch_size": self.dpo.batch_size}
        return {"grpo.prompts_per_step": self.grpo.prompts_per_step,
                "reward_model.batch_size": self.reward_model.batch_size}

    @model_validator(mode="after")
    def _check(self) -> "AlignmentGRPOConfig":
        self.grpo.check_rewards(set(RULE_REWARDS) | set(REWARD_MODELS))
        if REWARD_MODEL in self.grpo.rewards and {HELPFULNESS, HARMLESSNESS} & set(self.grpo.rewards):
            raise ValueError(f"alignment_grpo.grpo.rewards names {REWARD_MODEL!r} (one reward model for every general "
                             f"prompt) and {HELPFULNESS!r}/{HARMLESSNESS!r} (one for each category): name one or the "
                             f"other")
        for field in ("reward_model_uris", "reward_model_steps"):
            unknown = sorted(set(getattr(self, field)) - set(REWARD_MODELS))
            if unknown:
                raise ValueError(f"alignment_grpo.{field} names {unknown}; expected reward model names among "
                                 f"{list(REWARD_MODELS)}")
        if self.grpo.grading.supervision != "outcome":  # its general prompts have no steps to check
            raise ValueError("alignment_grpo.grpo.grading.supervision must be 'outcome': process supervision is "
                             "offered in reasoning_grpo, whose prompts have checkable steps")
        if self.algorithm == "dpo":
            if self.reward_model_uri is not None or self.reward_model.refresh_every:
                raise ValueError("alignment_grpo.reward_model_uri and reward_model.refresh_every are GRPO's reward "
                                 "model's; algorithm dpo trains on the preference pairs without one: unset them")
            return self
        synthetic = self.data.source == "synthetic" and self.general_source == "synthetic"
        check_prompts_per_step(self.grpo.prompts_per_step, self.data.num_train + self.general_prompts if synthetic else None)
        check_fsdp_settings(self.distributed, weights_dtype=self.grpo.memory.weights_dtype,
                            optimizer=self.grpo.optimizer.name)
        check_async_rollout(self.grpo.rollout, engine=self.distributed.engine, algorithm=self.algorithm,
                            where="alignment_grpo")
        if self.reward_model.refresh_every and REWARD_MODEL not in self.grpo.rewards:
            raise ValueError(f"alignment_grpo.reward_model.refresh_every trains the reward model further as GRPO "
                             f"runs, but grpo.rewards does not name {REWARD_MODEL!r} (it names "
                             f"{sorted(self.grpo.rewards)}): add it, or set refresh_every to 0")
        return self


class Recipe(BaseModel):
    """A whole pipeline's settings: one section per stage."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = "tiny"  # shown in MLflow as the pipeline run's `recipe` tag
    description: str = ""  # one line for people
    cold_start_sft: ColdStartSFTConfig = Field(default_factory=ColdStartSFTConfig)
    reasoning_grpo: ReasoningGRPOConfig = Field(default_factory=ReasoningGRPOConfig)
    rejection_sampling: RejectionSamplingConfig = Field(default_factory=RejectionSamplingConfig)
    sft: SFTStageConfig = Field(default_factory=SFTStageConfig)
    alignment_grpo: AlignmentGRPOConfig = Field(default_factory=AlignmentGRPOConfig)
    # the work pools stages may be placed on (a stage's resources.pool), each with what one flow run can be given
    pools: dict[str, PoolConfig] = Field(default_factory=dict)
    sweep: SweepConfig | None = None  # what `r1 sweep --recipe <this>` varies (grpo/configs/sweep.py); `r1 run` ignores it

    def stage_configs(self) -> dict[str, StageConfig]:
        """Each stage's settings by name, in the recipe's order."""
        return {name: getattr(self, name) for name in STAGES}

    @model_validator(mode="before")
    @classmethod
    def _one_ray_cluster(cls, data: Any) -> Any:
        """A training stage on Ray (`distributed.engine: ray`), or asynchronous rollouts on Ray actors
        (`grpo.rollout.launcher: ray`), without a `ray_address` of its own use the cluster the recipe names for
        rejection sampling."""
        if not isinstance(data, Mapping):
            return data
        cluster = (data.get("rejection_sampling") or {}) if isinstance(data.get("rejection_sampling"), Mapping) else {}
        address = (cluster.get("cluster") or {}).get("ray_address") if isinstance(cluster.get("cluster"), Mapping) \
            else None
        if not address:
            return data
        data = dict(data)
        for name in ("cold_start_sft", "reasoning_grpo", "sft", "alignment_grpo"):
            section = data.get(name)
            dist = section.get("distributed") if isinstance(section, Mapping) else None
            if isinstance(dist, Mapping) and dist.get("engine") == "ray" and not dist.get("ray_address"):
                section = data[name] = {**section, "distributed": {**dist, "ray_address": address}}
            grpo = section.get("grpo") if isinstance(section, Mapping) else None
            rollout = grpo.get("rollout") if isinstance(grpo, Mapping) else None
            if isinstance(rollout, Mapping) and rollout.get("launcher") == "ray" and not rollout.get("ray_address"):
                dist = dist if isinstance(dist, Mapping) else {}
                chosen = rollout_ray_address(None, dist.get("engine"), dist.get("ray_address"), address)
                data[name] = {**section, "grpo": {**grpo, "rollout": {**rollout, "ray_address": chosen}}}
        return data

    @model_validator(mode="after")
    def _placed_on_declared_pools(self) -> "Recipe":
        for name, stage in self.stage_configs().items():
            res = stage.resources
            if res.pool is None:
                continue
            if res.pool not in self.pools:
                raise ValueError(f"{name}.resources.pool {res.pool!r} is not among the recipe's pools "
                                 f"{sorted(self.pools)}; declare it under `pools` with what a flow run there can have")
            if res.gpus > self.pools[res.pool].gpus:
                raise ValueError(f"{name}.resources.gpus ({res.gpus}) is more than pool {res.pool!r} can give one "
                                 f"flow run (pools.{res.pool}.gpus: {self.pools[res.pool].gpus})")
        return self

    def token_budgets(self) -> list[tuple[str, int, ModelConfig, bool]]:
        """(field, tokens, the model they run on, whether a prompt comes on top) for every length the recipe sets.

        A GRPO or rejection stage samples from the checkpoint of the stage before it, so its budgets are checked
        against the model that stage trained: stage 1's for stages 2 and 3, stage 4's for stage 5.
        """
        cs, rg, rs, sft, al = (self.cold_start_sft, self.reasoning_grpo, self.rejection_sampling, self.sft,
                               self.alignment_grpo)
        dpo = [("alignment_grpo.dpo.max_seq_len", al.dpo.max_seq_len, sft.model, False)] * (al.algorithm == "dpo")
        return dpo + [("cold_start_sft.train.max_seq_len", cs.train.max_seq_len, cs.model, False),
                ("cold_start_sft.eval.max_new_tokens", cs.eval.max_new_tokens, cs.model, True),
                ("reasoning_grpo.grpo.sampling.max_new_tokens", rg.grpo.sampling.max_new_tokens, cs.model, True),
                ("reasoning_grpo.eval.max_new_tokens", rg.eval.max_new_tokens, cs.model, True),
                ("rejection_sampling.rejection.sampling.max_new_tokens", rs.rejection.sampling.max_new_tokens,
                 cs.model, True),
                ("sft.train.max_seq_len", sft.train.max_seq_len, sft.model, False),
                ("sft.eval.max_new_tokens", sft.eval.max_new_tokens, sft.model, True),
                ("alignment_grpo.grpo.sampling.max_new_tokens", al.grpo.sampling.max_new_tokens, sft.model, True),
                ("alignment_grpo.eval.max_new_tokens", al.eval.max_new_tokens, sft.model, True),
                ("alignment_grpo.reward_model.max_seq_len", al.reward_model.max_seq_len, al.reward_model.model, False)]

    @model_validator(mode="after")
    def _fits_tiny_context(self) -> "Recipe":
        for field, tokens, model, plus_prompt in self.token_budgets():
            if model.name_or_path == TINY:  # a folder's context is read from its config.json by check_recipe
                check_fits_context(field, tokens, model.tiny.max_position_embeddings, plus_prompt)
        return self


# the stages in the recipe's order: its sections that are a stage's settings
STAGES = tuple(name for name, f in Recipe.model_fields.items()
               if isinstance(f.annotation, type) and issubclass(f.annotation, StageConfig))

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"


class RecipeError(ValueError):
    """A recipe file that cannot be used, naming the file and the field."""


def load_recipe(name_or_path: str | Path) -> Recipe:
    """A recipe by name (`recipes/<name>.yaml`) or by path; unknown or mistyped fields fail here, naming them."""
    path = _recipe_path(name_or_path)
    data = _recipe_data(path, [])
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(f"{path}: {describe_errors(e, Recipe)}") from None


def _recipe_path(name_or_path: str | Path, beside: Path | None = None) -> Path:
    path = Path(name_or_path)
    if not path.suffix:
        path = RECIPES_DIR / f"{name_or_path}.yaml"
    elif beside is not None and not path.is_absolute():
        path = beside / path
    if not path.is_file():
        known = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
        raise RecipeError(f"no recipe {str(name_or_path)!r} (looked for {path}); known recipes: {known}")
    return path


def _recipe_data(path: Path, seen: list[Path]) -> dict:
    """The file's settings; with `base: <recipe>` (a name, or a path beside this file), the base's settings with
    this file's merged over them: a mapping key by key, anything else (a list, a value) replaced whole. A GRPO
    setting named as before the sections is put in its section first, so it overrides a base that names it there."""
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise RecipeError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    # an empty file (or one of comments only) would otherwise run the whole default recipe without a word
    if data is None:
        raise RecipeError(f"{path}: the recipe is empty (no settings, only blank lines or comments); expected "
                          f"sections such as `cold_start_sft:` (recipes/tiny.yaml is an example)")
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: expected a mapping of recipe sections (name, cold_start_sft, ...), got a "
                          f"{type(data).__name__}")
    base = data.pop("base", None)
    data, moved = sectioned(Recipe, data)
    warn_flat_names(moved, str(path))
    if base is None:
        return data
    if not isinstance(base, str):
        raise RecipeError(f"{path}: base: expected a recipe name or a YAML path, got {base!r}")
    base_path = _recipe_path(base, beside=path.parent)
    chain = [*seen, path.resolve()]
    if base_path.resolve() in chain:
        raise RecipeError(f"{path}: base: {base!r} leads back to itself "
                          f"({' -> '.join(str(p) for p in [*chain, base_path.resolve()])})")
    return _merged(_recipe_data(base_path, chain), data)


def _merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def apply_overrides(recipe: Recipe, overrides: Mapping[str, Any] | None) -> Recipe:
    """The recipe with each dotted path set to its value, checked like a recipe file.

    >>> recipe = apply_overrides(Recipe(), {"reasoning_grpo.grpo.optimizer.learning_rate": 2e-5})
    >>> recipe.reasoning_grpo.grpo.optimizer.learning_rate
    2e-05

    A value replaces the field whole (a dict given for a section replaces that section). An unknown path or a value
    the field does not take is a RecipeError naming the path and what was expected.
    """
    if not overrides:
        return recipe
    warn_flat_names([(str(p), new) for p, value in overrides.items() if (new := setting_path(p, value)) != str(p)])
    data = recipe.model_dump()
    for path, value in overrides.items():
        _set_path(data, path, value)
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(f"recipe {recipe.name!r} with overrides: {describe_errors(e, Recipe)}") from None


def setting_path(path: str, value: Any = None) -> str:
    """The path an override path sets: `reasoning_grpo.grpo.beta` -> `reasoning_grpo.grpo.loss.beta` (a flat GRPO
    name read into its section; `value` tells a name for `optimizer` from the section)."""
    return ".".join(unmoved_path(Recipe, str(path).split("."), value))


def _set_path(data: dict, path: str, value: Any) -> None:
    """Set `data[a][b][c] = value` for path "a.b.c", where each of a and b is a section of the recipe."""
    keys = str(path).split(".")
    if "" in keys:
        raise RecipeError(f"override {path!r}: expected a dotted path to a recipe field, such as "
                          f"reasoning_grpo.grpo.optimizer.learning_rate")
    keys = unmoved_path(Recipe, keys, value)
    node = data
    for depth, key in enumerate(keys):
        here = ".".join(keys[:depth])
        known = fields_at(Recipe, tuple(keys[:depth]))  # empty below a settings model: a dict such as grpo.rewards
        if known and key not in known:  # checked here, not left to pydantic, so the message names the whole path
            close = difflib.get_close_matches(key, known + also_known(Recipe, tuple(keys[:depth])), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known there: {known}"
            raise RecipeError(f"override {path!r}: {here or 'the recipe'} has no field {key!r}; {hint}")
        if depth == len(keys) - 1:
            node[key] = value
            return
        if node.get(key) is None and fields_at(Recipe, tuple(keys[:depth + 1])):
            node[key] = {}  # an optional section left out (such as rejection_sampling.judge): start it empty
        if not isinstance(node.get(key), dict):
            raise RecipeError(f"override {path!r}: {'.'.join(keys[:depth + 1])} is a setting "
                              f"({type(node.get(key)).__name__}), not a section with fields")
        node = node[key]
