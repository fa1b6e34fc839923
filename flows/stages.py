"""Every stage flow by name, with the upstream URI each needs when run alone."""

from flows.cold_start_sft import cold_start_sft
from flows.reasoning_grpo import reasoning_grpo

FLOWS = {"cold_start_sft": cold_start_sft, "reasoning_grpo": reasoning_grpo}
NEEDS_CHECKPOINT = {"reasoning_grpo"}
