"""Stage 3, rejection sampling: what is sampled, filtered and kept (`RejectionConfig`), and where its shard tasks
run and write (`ClusterConfig`).

Plain pydantic: imports nothing of torch or of the modules that do the work, so a recipe is read and checked
before anything heavy loads.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from grpo.configs.code import CodeConfig
from grpo.configs.grading import LANGUAGES
from grpo.configs.sampling import SamplingConfig

# The names the settings may use; grpo.rejection.filters checks that it offers exactly these.
READABILITY_FILTERS = ("tags", "language", "paragraph_length", "reasoning_length", "code_in_reasoning", "empty_answer",
                       "repetition")  # rejection sampling's readability filters


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
