"""Every stage flow by name, for the command line and deployments."""

from flows.cold_start_sft import cold_start_sft

FLOWS = {"cold_start_sft": cold_start_sft}
