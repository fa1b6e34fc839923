"""Every setting of the pipeline's parts: models, data, sampling, the training loops, the judge, rejection sampling.

Each is a frozen pydantic model with a default and a one-line comment per field; the stage configs and the recipe
that hold them are in `grpo.configs.recipe`. Defaults are the `tiny` recipe's values.

Plain pydantic: must not import torch, transformers or the modules that do the work, so a recipe is read and
checked in well under a second.
"""

from __future__ import annotations

import math
import string
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from grpo.configs.checks import Precision
from grpo.configs.code import CodeConfig
from grpo.configs.lora import LoRAConfig
from grpo.configs.rollout import RolloutConfig
from grpo.configs.schedule import ScheduleConfig
from grpo.texts import JUDGE_PROMPT, JUDGE_TEMPLATE_FIELDS

# The names the settings may use; the modules that implement them check that they agree (grpo.data.arithmetic,
# grpo.rejection.filters), so a recipe is checked without importing them.
TASK_TEMPLATES = ("farm", "shop", "book", "boxes", "bus", "coins")  # synthetic word-problem templates
READABILITY_FILTERS = ("tags", "language", "paragraph_length", "reasoning_length", "code_in_reasoning", "empty_answer",
                       "repetition")  # rejection sampling's readability filters
# what a stage reads from a dataset row (data.columns maps them); tests, io_tests and setup are the code reward's
DATA_ROLES = ("prompt", "answer", "response", "tests", "io_tests", "setup")
AnswerFormat = Literal["plain", "gsm8k", "boxed"]  # how a reference answer is read from its column (grpo.data.formats)
ANSWER_FORMATS = get_args(AnswerFormat)
TINY = "tiny"  # the model name that means "build the embedded model from ModelConfig.tiny"
SELF_JUDGE = "checkpoint"  # JudgeConfig.model: the checkpoint being sampled judges its own samples
# transformers' schedulers that need nothing beyond the warmup and total steps (grpo.training.schedules has them)
LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                 "inverse_sqrt")
LANGUAGES = ("en", "zh")  # what a chain of thought can be checked to be written in (grpo.rewards.language)
# the rule rewards a recipe can name under grpo.rewards: grpo.rewards.registry scores each by this name
RULE_REWARDS = ("format", "format_strict", "accuracy", "tag_count", "language_consistency", "overlong", "code")
REWARD_MODEL = "reward_model"  # the reward name that means the alignment stage's reward model
STEP_VERIFIERS = ("arithmetic", "gsm8k", "prm")  # process supervision's step verifiers (grpo.rewards.steps, .training.prm)


# ----------------------------------------------------------------------------------------------------------------
# Component settings: each is a section of a stage config

class TinyModelConfig(BaseModel):
    """Shape of the embedded model (defaults: 2.97M parameters, measured to learn the format in about a minute)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden_size: int = Field(256, ge=2)  # width of the residual stream
    intermediate_size: int = Field(688, ge=1)  # MLP width
    num_hidden_layers: int = Field(4, ge=1)  # transformer blocks
    num_attention_heads: int = Field(4, ge=1)  # query heads
    num_key_value_heads: int = Field(2, ge=1)  # grouped-query KV heads
    max_position_embeddings: int = Field(512, ge=2)  # longest prompt + completion, in tokens
    seed: int = 0  # weight initialisation seed: the same seed builds the same base model
    tokenizer: Literal["bpe", "byte"] = "bpe"  # BPE trained on the project's own text, or one token per byte
    vocab_size: int = Field(1024, ge=300, le=8192)  # BPE only: bytes, markers, tags and learned merges in all

    @model_validator(mode="after")
    def _heads_divide(self) -> "TinyModelConfig":
        if self.hidden_size % (2 * self.num_attention_heads):  # rotary embeddings rotate pairs of a head's dims
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of 2 x num_attention_heads "
                             f"({self.num_attention_heads}): each head's width must be even")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        return self


class ModelConfig(BaseModel):
    """Which model a stage starts from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name_or_path: str = TINY  # "tiny" builds the embedded model; anything else goes to from_pretrained
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)  # used only when name_or_path == "tiny"
    trust_remote_code: bool = False  # off unless the recipe turns it on
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # weights dtype when loading
    attn_implementation: str | None = None  # e.g. "sdpa" or "flash_attention_2"; None lets transformers pick


class TaskConfig(BaseModel):
    """The synthetic arithmetic word-problem task."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_operand: int = Field(9, ge=1)  # largest number drawn; the difficulty dial (single digits: minutes to learn)
    templates: tuple[str, ...] = Field(TASK_TEMPLATES, min_length=1)  # which problem templates to draw from
    heldout_percent: int = Field(20, ge=1, le=99)  # share of problems reserved for held-out, by hash of the problem
    seed: int = 0  # the same seed draws the same training problems (the held-out split never changes)
    restate_givens: bool = True  # the chain of thought starts by copying out the problem's numbers
    # share of the worked solutions that count each addition and subtraction out one number at a time
    # ("9 + 3 = 10 11 12.") instead of recalling the result ("9 + 3 = 12."); the rest recall. A small model taught
    # both habits picks one per answer, which leaves reasoning RL a choice to learn from (see recipes/tiny.yaml)
    counting_share: float = Field(0.4, ge=0.0, le=1.0)

    @field_validator("templates")
    @classmethod
    def _known_templates(cls, templates: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [t for t in templates if t not in TASK_TEMPLATES]
        if unknown:
            raise ValueError(f"unknown task template(s) {unknown}; known: {list(TASK_TEMPLATES)}")
        return templates


class DataConfig(BaseModel):
    """Where a stage's rows come from: the synthetic task, or a user dataset."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # "synthetic", a .jsonl/.json/.parquet/.csv file, a `datasets` folder (saved with save_to_disk, or data files
    # that load_dataset reads), or a hub name (load_dataset(source, subset, split=split))
    source: str = "synthetic"
    subset: str | None = None  # the dataset's configuration (hub datasets and data-file folders; GSM8K: "main")
    split: str = "train"  # split to read from a hub dataset or a DatasetDict folder
    # role -> the dataset's column: {prompt: question} reads prompts from `question`; a role not named here is read
    # from the column of its own name. Roles: prompt, answer (the reference), response (SFT targets), and for the
    # code reward tests (assert statements, MBPP's test_list), io_tests ({inputs, outputs} on stdin/stdout) and
    # setup (code run before the tests, MBPP's test_setup_code); a row with tests needs no answer
    columns: dict[str, str] = Field(default_factory=dict)
    # how the reference answer is read from the answer column: "plain" (as it is), "gsm8k" (the number after
    # "####", commas removed) or "boxed" (the last \boxed{...}, as in MATH). With gsm8k or boxed and no response
    # column, SFT rows are built from the worked solution: <think>solution</think><answer>final</answer>
    answer_format: AnswerFormat = "plain"
    # a row whose reference cannot be read in answer_format (gsm8k: no number after "####"; boxed: no \boxed{}):
    # "error" stops before any model with the file, row and value; "drop" leaves it out and reports how many
    unreadable_answers: Literal["error", "drop"] = "error"
    num_train: int = Field(2000, ge=0)  # synthetic rows to generate (or the most rows to read from a user dataset; 0 = all)
    num_heldout: int = Field(200, ge=0)  # held-out rows for evaluation (0 = no evaluation)
    # held-out (prompt, answer) rows: "synthetic" (the task's split) or a user dataset, read with the same
    # subset, columns and answer_format as the training rows
    heldout_source: str = "synthetic"
    heldout_split: str = "test"  # split to read held-out rows from (hub datasets and DatasetDict folders)
    task: TaskConfig = TaskConfig()  # the synthetic task

    @field_validator("columns")
    @classmethod
    def _known_roles(cls, columns: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(columns) - set(DATA_ROLES))
        if unknown:
            raise ValueError(f"unknown role(s) {unknown} in columns; the roles are {list(DATA_ROLES)} "
                             f"(write role: dataset_column, e.g. prompt: question)")
        empty = [role for role, column in columns.items() if not column.strip()]
        if empty:
            raise ValueError(f"columns maps {empty} to an empty column name")
        return columns


class SamplingConfig(BaseModel):
    """How completions are sampled."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_new_tokens: int = Field(96, ge=1)  # completion budget in tokens; leave room, a truncated completion earns nothing
    temperature: float = Field(1.0, ge=0)  # 0 means greedy
    top_p: float = Field(1.0, gt=0, le=1)  # nucleus sampling; 1.0 keeps the whole distribution
    top_k: int = Field(0, ge=0)  # 0 keeps every token
    batch_size: int = Field(64, ge=1)  # sequences decoded together (prompts x n are cut into batches of this many)


class EvalConfig(BaseModel):
    """Held-out evaluation."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_prompts: int = Field(200, ge=0)  # held-out prompts scored (0 = all)
    num_samples: int = Field(4, ge=0)  # k for sample_accuracy and pass_at_k (0 skips sampling)
    temperature: float = Field(1.0, ge=0)  # sampling temperature for the k samples
    max_new_tokens: int = Field(96, ge=1)  # completion budget
    batch_size: int = Field(128, ge=1)  # sequences decoded together
    num_logged_samples: int = Field(16, ge=0)  # completions kept in the samples table
    # also eval/step_accuracy: the share of the greedy answers' reasoning steps this rule verifier says hold
    # ("arithmetic": the synthetic task's equations; "gsm8k": GSM8K's <<a*b=c>> steps); None: not measured
    step_verifier: Literal["arithmetic", "gsm8k"] | None = None


class SFTConfig(BaseModel):
    """The supervised fine-tuning loop."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_steps: int = Field(500, ge=1)  # optimizer steps
    batch_size: int = Field(32, ge=1)  # rows per micro-batch
    grad_accum_steps: int = Field(1, ge=1)  # micro-batches per optimizer step
    learning_rate: float = Field(2e-3, gt=0)  # peak rate (a from-scratch tiny model takes a large one; real ~1e-5)
    lr_scheduler: Literal[LR_SCHEDULERS] = "cosine"  # a transformers scheduler name
    warmup_steps: int = Field(20, ge=0)  # linear warmup
    weight_decay: float = Field(0.0, ge=0)  # AdamW weight decay
    max_grad_norm: float = Field(1.0, gt=0)  # gradient clipping
    max_seq_len: int = Field(384, ge=2)  # prompt + response tokens; longer rows are cut at the end of the response
    mixed_precision: Precision = "auto"  # auto (bf16 where native, else fp32), bf16, fp16 (GPU) or no
    # fp32 linears on a CPU: "auto" times MKL (torch's default path) and oneDNN on the loop's shapes and keeps the
    # faster of each GEMM (grpo.kernels.gemm); "mkl" or "onednn" forces one
    fp32_gemm: Literal["auto", "mkl", "onednn"] = "auto"
    gradient_checkpointing: bool = False  # trade compute for memory on real models
    # each micro-batch's rows as one row without padding (grpo.training.packing), the same loss: "auto" where the
    # model's attention takes packed rows exactly (Qwen2/Llama on SDPA or eager, any model on flash attention)
    packing: bool | Literal["auto"] = "auto"
    # a memory bound: each micro-batch's rows go through the model in packed pieces of at most this many tokens
    # (whole rows in order), the loss still the token mean over the micro-batch; None = one forward a micro-batch
    max_tokens_per_microbatch: int | None = Field(None, ge=1)
    checkpoint_every: int = Field(100, ge=0)  # steps between resumable checkpoints (0 = only at the end)
    keep_checkpoints: int = Field(2, ge=1)  # resumable checkpoints kept on disk (two: a damaged newest falls back)
    log_every: int = Field(10, ge=1)  # steps between metric callbacks
    seed: int = 0  # data order and dropout

    @model_validator(mode="after")
    def _budget_needs_packing(self) -> "SFTConfig":
        if self.max_tokens_per_microbatch is not None and self.packing is False:
            raise ValueError("max_tokens_per_microbatch splits micro-batches into packed pieces; it needs packing: "
                             "true or auto (or leave it out: one forward a micro-batch)")
        return self


class GRPOConfig(BaseModel):
    """The GRPO loop (names follow TRL's GRPOConfig where they mean the same thing)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_steps: int = Field(200, ge=1)  # optimizer steps (times num_iterations)
    prompts_per_step: int = Field(4, ge=1)  # distinct prompts sampled per step
    num_generations: int = Field(8, ge=2)  # G: completions per prompt (a group of one has no advantage)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)  # temperature, completion budget
    learning_rate: float = Field(1e-5, gt=0)  # AdamW learning rate; large ones destroy a tiny model's skills
    lr_scheduler: Literal[LR_SCHEDULERS] = "constant_with_warmup"  # a transformers scheduler name
    warmup_steps: int = Field(0, ge=0)  # linear warmup
    weight_decay: float = Field(0.0, ge=0)  # AdamW weight decay
    max_grad_norm: float = Field(1.0, gt=0)  # gradient clipping
    beta: float = Field(0.04, ge=0)  # KL coefficient (DeepSeekMath); 0 skips the reference model entirely
    epsilon: float = Field(0.2, gt=0)  # lower clip range of the ratio
    epsilon_high: float | None = Field(None, gt=0)  # upper clip range (DAPO's clip-higher); None = epsilon
    num_iterations: int = Field(1, ge=1)  # mu: optimisation passes per batch of samples
    # grpo (mean of sequence means), bnpo (token mean per micro-batch), dapo (token mean over the whole batch, DAPO
    # arXiv:2503.14476, TRL's default) or dr_grpo (token sum / (rows x completion budget), Dr. GRPO arXiv:2503.20783)
    loss_type: Literal["grpo", "bnpo", "dapo", "dr_grpo"] = "grpo"
    # ratio per "token", or one per "sequence": exp(mean log-ratio), clipped per sequence (GSPO, arXiv:2507.18071;
    # the paper pairs it with loss_type grpo)
    importance_sampling_level: Literal["token", "sequence"] = "token"
    # truncated importance sampling (Yao et al. 2025): each token's policy term times min(pi_train/pi_sampler, cap),
    # correcting for a sampler whose numbers differ from the trainer's (bf16 copy, vLLM); None = off
    tis_cap: float | None = Field(None, gt=0)
    scale_rewards: Literal["group", "batch", "none"] = "group"  # advantage scaling (none: Dr. GRPO)
    # outcome: one reward per completion; process: a reward at the end of every reasoning step, normalised over the
    # group's steps, a token's advantage the sum over the steps that end at or after it (DeepSeekMath 4.1.3)
    supervision: Literal["outcome", "process"] = "outcome"
    # process only: who checks the steps: "arithmetic" (the synthetic task's equations), "gsm8k" (calculator
    # annotations and plain equations, a line a step) or "prm" (a process reward model, at prm_path)
    step_verifier: Literal[STEP_VERIFIERS] | None = None
    prm_path: str | None = None  # step_verifier prm: the process reward model's folder or runs:/ URI
    rewards: dict[str, float] = Field(default_factory=lambda: {"accuracy": 1.0, "format": 0.5})  # name -> weight
    code: CodeConfig = Field(default_factory=CodeConfig)  # the code reward's settings, read when rewards name code
    dynamic_sampling: bool = False  # DAPO: drop groups with no reward spread and refill the batch
    mask_truncated_completions: bool = False  # DAPO's overlong filtering: completions cut off by the budget add no loss
    max_refill_rounds: int = Field(3, ge=0)  # extra sampling rounds per step when dynamic sampling
    # rows a grader could not grade (a timeout, a sandbox or judge failure, a reward that raised: they train
    # nothing). The stage stops in one line, its steps kept, once more than this share of the rows of the last
    # ungraded_window steps were ungraded (1.0: never stops for it)
    max_ungraded_share: float = Field(0.05, ge=0, le=1)
    ungraded_window: int = Field(10, ge=1)
    # steps in a row whose groups all tie (no reward spread: every advantage 0) before the stage says so in one
    # line; with stop_without_signal it also stops there, its steps kept
    no_signal_steps: int = Field(20, ge=1)
    stop_without_signal: bool = False
    # a judge that looks again at the answers the accuracy rule scored 0.0 (grpo.training.appeal): it may only raise
    appeal: JudgeConfig | None = None
    micro_batch_size: int = Field(32, ge=1)  # sequences per forward/backward (gradient accumulation inside a step)
    # each micro-batch's rows as one row without padding (grpo.training.packing), the same numbers: "auto" where the
    # model's attention takes packed rows exactly (Qwen2/Llama on SDPA or eager, any model on flash attention)
    packing: bool | Literal["auto"] = "auto"
    # packed micro-batches filled with whole rows to this many tokens (prompt + completion); None = micro_batch_size rows
    max_tokens_per_microbatch: int | None = Field(None, ge=1)
    # recompute each layer in the backward: less memory, one more forward; "auto": on a GPU, off on a CPU
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    mixed_precision: Precision = "auto"  # auto (bf16 where native, else fp32), bf16, fp16 (GPU) or no
    # fp32 linears on a CPU: "auto" times MKL (torch's default path) and oneDNN on the loop's shapes and keeps the
    # faster of each GEMM (grpo.kernels.gemm); "mkl" or "onednn" forces one
    fp32_gemm: Literal["auto", "mkl", "onednn"] = "auto"
    # the frozen reference's weights: "auto" is bf16 on a GPU whose loop runs in bf16 (half its memory), else the
    # policy's dtype
    reference_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # the policy's weights while training: "float32", or "bfloat16" (weights, gradients, reference and sampling in
    # bf16; the optimizer steps fp32 master copies with fp32 state, and the saved model is the fp32 masters)
    weights_dtype: Literal["float32", "bfloat16"] = "float32"
    optimizer: Literal["adamw", "adamw_8bit"] = "adamw"  # adamw_8bit: bitsandbytes' AdamW8bit (8-bit moments)
    lora: LoRAConfig | None = None  # train LoRA adapters instead of every weight (needs peft); None = full model
    log_every: int = Field(1, ge=1)  # steps between metric callbacks
    samples_every: int = Field(25, ge=0)  # steps between sample-completion tables (0 = none)
    checkpoint_every: int = Field(50, ge=0)  # steps between resumable checkpoints (0 = only the final model)
    seed: int = 0  # prompt order and sampling
    # each step's prompts by the rows' `kind`: {kind: share of prompts_per_step}, e.g. {general: 0.5} (alignment: R1
    # mixes general and reasoning prompts in every batch); other kinds share the rest. Empty: all rows alike
    prompt_mix: dict[str, Annotated[float, Field(gt=0, le=1)]] = Field(default_factory=dict)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)  # sync, or async sampler workers (docs/sampling.md)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)  # rewards that start late, a reference that moves

    @field_validator("rewards")
    @classmethod
    def _some_rewards(cls, rewards: dict[str, float]) -> dict[str, float]:
        if not rewards:
            raise ValueError("name at least one reward, e.g. {accuracy: 1.0}")
        bad = {k: w for k, w in rewards.items() if not math.isfinite(w)}
        if bad:
            raise ValueError(f"reward weights must be finite numbers, got {bad}")
        return rewards

    @model_validator(mode="after")
    def _process_needs_steps(self) -> "GRPOConfig":
        if sum(self.prompt_mix.values()) > 1 + 1e-9:
            raise ValueError(f"prompt_mix shares add up to more than 1: {self.prompt_mix}")
        if self.max_tokens_per_microbatch is not None and self.packing is False:
            raise ValueError("max_tokens_per_microbatch fills packed micro-batches; it needs packing: true or auto "
                             "(or leave it out: micro_batch_size rows a micro-batch)")
        if self.rollout.reference == "sampler" and (not self.rollout.asynchronous or self.beta == 0 or self.lora):
            raise ValueError("rollout.reference sampler scores the reference log-probs in the asynchronous workers: "
                             "it needs rollout.mode async, beta > 0 (else there is no KL term to score) and no LoRA "
                             "(whose reference is the policy with its adapters off, which the trainer holds); set "
                             "rollout.reference trainer")
        if self.rollout.asynchronous and self.dynamic_sampling:
            raise ValueError("rollout.mode async samples each step's prompts once, in a worker, before it is scored: "
                             "dynamic_sampling's refills need the scores first; turn one of them off")
        if self.supervision == "process" and "code" in self.rewards:  # before asking for a verifier: none would do
            raise ValueError("supervision 'process' cannot be used with the code reward (rewards names code): its "
                             "step verifiers check reasoning steps, and none checks code; set supervision: outcome, "
                             "or take code out of rewards")
        if self.supervision == "process":
            if self.step_verifier is None:
                raise ValueError(f"supervision 'process' needs a step_verifier to score the steps: one of "
                                 f"{list(STEP_VERIFIERS)} (arithmetic for the synthetic task, gsm8k for GSM8K-style "
                                 f"solutions)")
            if self.importance_sampling_level != "token":
                raise ValueError("supervision 'process' gives every token its own advantage; it needs "
                                 "importance_sampling_level 'token' (GSPO's one ratio a sequence goes with one "
                                 "advantage a sequence)")
        elif self.step_verifier is not None or self.prm_path is not None:
            raise ValueError("step_verifier and prm_path are used only with supervision 'process'; set "
                             "supervision: process, or remove them")
        self.schedule.check(self.rewards, self.max_steps, self.beta,
                            self.lora is None and self.rollout.reference != "sampler")
        if (self.step_verifier == "prm") != (self.prm_path is not None):
            raise ValueError("step_verifier 'prm' and prm_path go together: prm_path names the process reward "
                             "model's folder or runs:/ URI")
        return self

    def check_rewards(self, known: set[str]) -> None:
        """Raise if a reward is not among the `known` names (the stage configs know which ones they offer)."""
        unknown = sorted(set(self.rewards) - known)
        if unknown:
            raise ValueError(f"unknown reward(s) {unknown} in grpo.rewards; known here: {sorted(known)}")


class JudgeConfig(BaseModel):
    """Which judge to ask and how."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: Literal["transformers", "http"] = "transformers"  # a local model, or an OpenAI-compatible endpoint
    model: str = "tiny"  # transformers: checkpoint folder, hub name or "tiny"; http: the served model's name
    base_url: str = "http://127.0.0.1:8000/v1"  # http only: endpoint root, the part before /chat/completions
    api_key_env: str = "R1_JUDGE_API_KEY"  # http only: NAME of the env var holding the key (sent as a Bearer token)
    max_new_tokens: int = Field(128, ge=1)  # the judge's reply budget; a reasoning judge needs far more
    temperature: float = Field(0.0, ge=0.0)  # 0 = greedy, so the same response gets the same verdict
    timeout_s: float = Field(60.0, gt=0)  # http only: per-request socket timeout
    max_retries: int = Field(2, ge=0)  # http only: further tries after a connection error, timeout, 5xx or 429
    backoff_s: float = Field(1.0, ge=0)  # http only: wait before the first retry; doubles on each further one
    # http only: requests in flight to the endpoint at once, from all of a process's shard tasks together; the
    # server batches the requests in flight (a chat request carries one conversation), so this is the judge's batch
    max_workers: int = Field(4, ge=1)
    batch_size: int = Field(16, ge=1)  # transformers only: judge prompts decoded together
    prompt_template: str = JUDGE_PROMPT  # str.format template with {question}, {reference} and {response}

    @field_validator("prompt_template")
    @classmethod
    def _known_fields(cls, template: str) -> str:
        try:
            fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
        except ValueError as e:  # an unmatched brace
            raise ValueError(f"prompt_template is not a valid str.format template ({e}); write literal braces "
                             f"as {{{{ and }}}}") from None
        unknown = fields - JUDGE_TEMPLATE_FIELDS
        if unknown:
            raise ValueError(f"prompt_template uses unknown fields {sorted(unknown)}; "
                             f"the known ones are {sorted(JUDGE_TEMPLATE_FIELDS)}")
        if "response" not in fields:
            raise ValueError("prompt_template must contain {response}, or the judge never sees what it judges")
        return template

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {url!r}")
        return url.rstrip("/")


GRPOConfig.model_rebuild()  # `appeal` names JudgeConfig, defined after it


class GenerationConfig(BaseModel):
    """Which engine samples a stage's completions (`grpo.sampling.engines`): the model in this process, or (rejection
    sampling only) OpenAI-compatible servers."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: Literal["local", "http"] = "local"  # local: the model in this process; http: /v1/completions servers
    # local only: "auto" samples Qwen2/Qwen3/Llama/Mistral-style models with the paged-cache sampler (CUDA graphs on
    # a GPU) and other models step by step; "loop" always step by step (docs/sampling.md)
    sampler: Literal["auto", "loop"] = "auto"
    kv_cache_mb: int | None = Field(None, ge=1)  # local only: the K/V cache's page pool at most; None: half the
    #                                              GPU's free memory (no limit on a CPU); rows beyond it wait their turn
    endpoints: tuple[str, ...] = ()  # http only: endpoint roots, the part before /completions (http://gpu-0:8000/v1)
    model: str = ""  # http only: the model name the endpoints serve (vLLM: --served-model-name)
    max_in_flight: int = Field(32, ge=1)  # http only: requests in flight at once per endpoint (per process)
    api_key_env: str = "R1_GENERATION_API_KEY"  # http only: NAME of the env var holding the key (a Bearer token)
    timeout_s: float = Field(1800.0, gt=0)  # http only: per request; one 32k-token trace at 30 tokens/s is 18 min
    retries: int = Field(3, ge=0)  # http only: further tries per sample, on another live endpoint where there is one
    backoff_s: float = Field(1.0, ge=0)  # http only: wait before a sample's first retry; doubles on each further one
    max_failures: int = Field(3, ge=1)  # http only: failures in a row that give an endpoint up (refused: at once)

    @field_validator("endpoints")
    @classmethod
    def _http_urls(cls, urls: tuple[str, ...]) -> tuple[str, ...]:
        bad = [u for u in urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"endpoints must start with http:// or https://, got {bad}")
        urls = tuple(u.rstrip("/") for u in urls)
        twice = sorted({u for u in urls if urls.count(u) > 1})
        if twice:
            raise ValueError(f"endpoints listed twice: {twice}")
        return urls

    @model_validator(mode="after")
    def _http_needs_servers(self) -> "GenerationConfig":
        if self.backend == "http" and not (self.endpoints and self.model):
            raise ValueError("backend 'http' needs endpoints (e.g. ['http://127.0.0.1:8000/v1']) and the model "
                             "name they serve")
        return self


class RejectionConfig(BaseModel):
    """Stage 3: rejection sampling (defaults are the tiny recipe's values)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    samples_per_prompt: int = Field(4, ge=1)  # completions sampled per prompt
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)  # completion budget and temperature
    target_samples: int = Field(400, ge=1)  # final rows, reasoning + non-reasoning (R1: 800k; tiny: hundreds)
    non_reasoning_rows: int = Field(0, ge=0)  # of target_samples, rows from the non-reasoning set (R1: 200k)
    max_kept_per_prompt: int = Field(2, ge=0)  # correct samples kept per prompt (0 = all): coverage over near-copies
    shard_size: int = Field(64, ge=1)  # prompts per shard: the unit that is written, skipped on resume, mapped over
    filters: tuple[str, ...] = READABILITY_FILTERS  # readability filters, in the order they run
    language: str = "en"  # the language the reasoning must be written in (R1 drops mixed-language chains of thought)
    min_language_share: float = Field(0.95, ge=0, le=1)  # least share of the reasoning's words in `language`
    max_paragraph_chars: int = Field(2000, ge=1)  # longest paragraph (text between blank lines) a response may have
    max_reasoning_chars: int = Field(8000, ge=1)  # longest think block in characters
    max_line_repeats: int = Field(3, ge=1)  # a line or sentence (8+ chars) seen more often than this is looping
    min_compression_ratio: float = Field(0.1, ge=0, le=1)  # zlib size / text size below this is looping
    # "no_reference": judge rows without an answer; "always": also ask it where the rule decides, to measure their
    # agreement; "appeal": also ask it where the rule says incorrect, and keep what it accepts (the rule's positives
    # stand); "never": drop rows without an answer
    judge_when: Literal["no_reference", "always", "appeal", "never"] = "no_reference"
    # how rows with tests (code) are checked: each sample's program must pass all of its row's tests in the sandbox
    code: CodeConfig = Field(default_factory=CodeConfig)
    dedupe: bool = True  # drop samples whose normalised text repeats an earlier one of the same prompt
    decontamination_ngram: int = Field(8, ge=0)  # word n-gram length matched against held-out prompts (0 = off)
    # share of a held-out prompt's n-grams that marks a row (on the tiny task 0.5 flags 39% of the training
    # problems, which share template wording with held-out ones; a copied problem shares about 90%)
    decontamination_threshold: float = Field(0.8, gt=0, le=1)
    seed: int = 0  # each shard's sampling seed derives from it; also the tie-break when capping to the target
    merge_batch_rows: int = Field(4096, ge=1)  # rows the merge reads and writes at a time: its memory for text

    @model_validator(mode="after")
    def _check(self) -> "RejectionConfig":
        unknown = [f for f in self.filters if f not in READABILITY_FILTERS]
        if unknown:
            raise ValueError(f"unknown readability filter(s) {unknown}; known: {list(READABILITY_FILTERS)}")
        if self.language not in LANGUAGES:
            raise ValueError(f"unsupported language {self.language!r}; supported: {sorted(LANGUAGES)}")
        if self.non_reasoning_rows >= self.target_samples:
            raise ValueError(f"non_reasoning_rows ({self.non_reasoning_rows}) must be below target_samples "
                             f"({self.target_samples}): the rest of the target is reasoning rows")
        return self


class ClusterConfig(BaseModel):
    """Where rejection sampling's shard tasks run and write: threads of this process by default, or a Ray cluster."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # None: threads of this process. "auto": the cluster named by $RAY_ADDRESS. Else a Ray GCS address host:port
    # (what `ray start --head` prints) or ray://host:port (the Ray client server)
    ray_address: str | None = None
    # where the shards are written: an fsspec URI every node and the driver can write (file:///shared/mount/r1,
    # s3://bucket/r1, gs://...); None = the local work folder (threads only). A rerun resumes from what it holds
    shard_store: str | None = None
    # GPUs each shard task asks Ray for. "auto": 1 when the shard loads a model (local generation or a transformers
    # judge) and the cluster has GPUs, else 0. A number: that many (0.5 packs two shards on a GPU). A task that asks
    # for none sees every GPU of its node, and every such task on the node would load its copy onto the first one
    gpus_per_shard: float | Literal["auto"] = "auto"

    @model_validator(mode="after")
    def _check(self) -> "ClusterConfig":
        if self.gpus_per_shard != "auto" and self.gpus_per_shard < 0:
            raise ValueError(f"gpus_per_shard is {self.gpus_per_shard}: give a number >= 0 or 'auto'")
        if self.ray_address is not None and not self.shard_store:
            raise ValueError("ray_address needs a shard_store: Ray nodes cannot write the driver's local work "
                             "folder; give an fsspec URI every node can write (file:///shared/mount/r1, s3://...)")
        return self
