"""Re-exports the settings now in their topic modules (model, data, sampling, grading, training, rejection)."""

from grpo.configs.code import CodeConfig  # noqa: F401
from grpo.configs.data import (ANSWER_FORMATS, DATA_ROLES, TASK_TEMPLATES, AnswerFormat, DataConfig,  # noqa: F401
                               TaskConfig)
from grpo.configs.grading import (LANGUAGES, REWARD_MODEL, RULE_REWARDS, SELF_JUDGE, STEP_VERIFIERS,  # noqa: F401
                                  JudgeConfig)
from grpo.configs.lora import LoRAConfig  # noqa: F401
from grpo.configs.model import TINY, ModelConfig, TinyModelConfig  # noqa: F401
from grpo.configs.rejection import READABILITY_FILTERS, ClusterConfig, RejectionConfig  # noqa: F401
from grpo.configs.sampling import EvalConfig, GenerationConfig, SamplingConfig  # noqa: F401
from grpo.configs.training import LR_SCHEDULERS, GRPOConfig, SFTConfig  # noqa: F401
