"""Each stage's pre-flight, by stage name: the data it reads, read and validated as the stage will read it, the
sandbox where it runs programs, and the models it loads by name (their context is checked against the recipe's
token budgets).

They live apart from the flow modules, which import Prefect and the stages' libraries (torch, MLflow) as they load,
so that `r1` runs them first: a bad data file is told in one line within seconds, before any of those is imported.
They import the recipe's configs, the data readers (pandas) and the helpers of flows/checks.py; MLflow only for a
`runs:/` URI the recipe names, torch only for an HTTP judge to ask. A stage that reads nothing of its own (its inputs
are other stages' URIs, checked where they are given) and loads no model by name has no entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from flows.checks import (UsageError, check_judge_endpoint, check_model_folder, check_rewards, check_sandbox,
                          check_uri, has_tests, looks_like_a_path, reading)
from grpo.configs.checks import check_prompts_per_step
from grpo.configs.grading import SELF_JUDGE
from grpo.configs.model import TINY, ModelConfig
from grpo.configs.recipe import AlignmentGRPOConfig, ColdStartSFTConfig, ReasoningGRPOConfig, RejectionSamplingConfig
from grpo.rejection.non_reasoning import MODEL


def check_cold_start_sft(cfg: ColdStartSFTConfig) -> None:
    """Pre-flight: what the stage reads, read and validated as it will be (no model loaded)."""
    from grpo.data.tables import load_sft_data

    with reading("cold_start_sft.data"):
        _, heldout = load_sft_data(cfg.data)
    if has_tests(heldout):  # evaluated after training, under the default limits (an SFT stage has no code section)
        check_sandbox("cold_start_sft.data.heldout_source")


def check_reasoning_grpo(cfg: ReasoningGRPOConfig) -> None:
    """Pre-flight: what the stage reads, read and validated as it will be (no model loaded)."""
    from grpo.data.tables import load_rl_data

    with reading("reasoning_grpo.data"):
        train, heldout = load_rl_data(cfg.data)
    check_rewards("reasoning_grpo", cfg.grpo, train, heldout)
    with reading("reasoning_grpo"):
        cfg.check_prompts(len(train), cfg.data.source)
    if cfg.grpo.grading.prm_path is not None:  # the process reward model that checks the steps
        if cfg.grpo.grading.prm_path.startswith("runs:/"):
            check_uri("reasoning_grpo.grpo.grading.prm_path", cfg.grpo.grading.prm_path)
        else:
            check_model_folder("reasoning_grpo.grpo.grading.prm_path", cfg.grpo.grading.prm_path)


def check_rejection_sampling(cfg: RejectionSamplingConfig) -> None:
    """Pre-flight: what the stage reads, read and validated as it will be (no model loaded)."""
    from grpo.data.tables import SFT_SCHEMA, load_rl_data, validated_batches

    with reading("rejection_sampling.data"):
        train, heldout = load_rl_data(cfg.data)
    rs = cfg.rejection
    # its rule check runs the training rows' tests; its held-out rows are the ones the SFT stage evaluates later
    if has_tests(train):
        check_sandbox("rejection_sampling.data", rs.code)
    elif has_tests(heldout):
        check_sandbox("rejection_sampling.data.heldout_source")
    if rs.non_reasoning_rows and cfg.non_reasoning_source not in ("synthetic", MODEL):
        with reading("rejection_sampling.non_reasoning_source"):  # the rows the stage takes, a batch at a time
            rows = sum(len(batch) for batch in validated_batches(cfg.non_reasoning_source, SFT_SCHEMA,
                                                                 limit=rs.non_reasoning_rows))
        if rows < rs.non_reasoning_rows:
            raise UsageError(f"rejection_sampling.non_reasoning_source: {cfg.non_reasoning_source} has {rows} "
                             f"rows; rejection.non_reasoning_rows asks for {rs.non_reasoning_rows}")
    judge = cfg.judge
    if judge is not None and rs.judge_when != "never":
        if judge.backend == "http":
            check_judge_endpoint(judge)
        elif judge.model not in (SELF_JUDGE, TINY):
            check_model_folder("rejection_sampling.judge.model", judge.model)


def check_alignment_grpo(cfg: AlignmentGRPOConfig) -> None:
    """Pre-flight: what the stage reads, read and validated as it will be (no model loaded)."""
    from grpo.data.general import CATEGORIES
    from grpo.data.preferences import load_preference_data
    from grpo.data.tables import DataError, load_rl_data, read_table, validate_rows

    with reading("alignment_grpo.data"):
        train, heldout = load_rl_data(cfg.data)
    if cfg.alignment_eval.enabled:
        from grpo.data.general import alignment_eval_sets

        with reading("alignment_grpo.alignment_eval"):
            alignment_eval_sets(cfg.alignment_eval)
    if cfg.algorithm == "dpo":  # no reward model, no general prompts: the preference pairs are what it reads
        with reading("alignment_grpo.preferences"):
            load_preference_data(cfg.preferences)
        return
    check_rewards("alignment_grpo", cfg.grpo, train, heldout)
    general = cfg.general_prompts
    if cfg.general_source != "synthetic":
        routed = {"helpfulness", "harmlessness"} & set(cfg.grpo.rewards)  # R1's two read each row's category
        schema = {"prompt": "text or chat messages", **({"category": "harmful, benign or borderline"} if routed else {})}
        with reading("alignment_grpo.general_source"):
            rows = validate_rows(read_table(cfg.general_source), schema, cfg.general_source)
            bad = [i for i, c in enumerate(rows["category"]) if c not in CATEGORIES] if routed else []
            if bad:
                raise DataError(f"{cfg.general_source}: row {bad[0]}, column 'category': expected one of "
                                f"{', '.join(CATEGORIES)} (it routes the row to its reward model), got "
                                f"{rows['category'].iat[bad[0]]!r:.80}")
        general = min(general, len(rows))
    with reading("alignment_grpo"):
        check_prompts_per_step(cfg.grpo.prompts_per_step, len(train) + general,
                               f"{cfg.data.source} with {general} general prompts")
    from grpo.configs.grading import REWARD_MODEL
    from grpo.configs.reward import REWARD_MODELS
    from grpo.data.preferences import pairs_for

    for name in (n for n in REWARD_MODELS if n in cfg.grpo.rewards):
        given = cfg.reward_model_uris.get(name) or (cfg.reward_model_uri if name == REWARD_MODEL else None)
        where = f"alignment_grpo.reward_model_uris.{name}" if name in cfg.reward_model_uris else \
            "alignment_grpo.reward_model_uri"
        if given is None:  # trained in the stage: its pairs are read as it will read them
            with reading("alignment_grpo.preferences"):
                pairs_for(load_preference_data(cfg.preferences)[0], name, cfg.preferences.source,
                          cfg.reward_model.helpfulness_reads == "answer")
        elif given.startswith("runs:/"):
            check_uri(where, given)
        elif looks_like_a_path(given):
            check_model_folder(where, given)


def _no_check(config: Any) -> None:
    """A stage whose inputs all come from other stages' URIs (checked where they are given) has nothing to read."""


@dataclass(frozen=True)
class Preflight:
    """What `r1` checks of one stage before anything starts."""

    check: Callable[[Any], None] = _no_check  # its data and sandbox, given its recipe section; raises UsageError
    # the models it loads by name, (recipe field, model settings): their context is checked against token budgets
    loads: Callable[[Any], list[tuple[str, ModelConfig]]] = field(default=lambda config: [])


PREFLIGHT = {
    "cold_start_sft": Preflight(check=check_cold_start_sft,
                                loads=lambda config: [("cold_start_sft.model.name_or_path", config.model)]),
    "reasoning_grpo": Preflight(check=check_reasoning_grpo),
    "rejection_sampling": Preflight(check=check_rejection_sampling),
    "sft": Preflight(loads=lambda config: [("sft.model.name_or_path", config.model)]),
    "alignment_grpo": Preflight(
        check=check_alignment_grpo,
        loads=lambda config: [] if config.reward_model_uri or config.algorithm == "dpo"
        or config.reward_model.from_policy else [
            # a given reward model trains nothing, DPO has none, and one from the policy loads the checkpoint
            ("alignment_grpo.reward_model.model.name_or_path", config.reward_model.model)]),
}


def preflight(stage: str) -> Preflight:
    """The stage's pre-flight (nothing to check for a stage without an entry)."""
    return PREFLIGHT.get(stage, Preflight())
