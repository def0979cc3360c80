"""offpolicy: stable RL for LLMs when the rollout engine and the training engine disagree."""

from offpolicy.batch import LogProbBatch
from offpolicy.corrections.base import Correction, CorrectionResult, chain
from offpolicy.ratios import (
    LOG_RATIO_BOUND,
    aggregate_log_ratio,
    decompose_log_ratio,
    log_ratio,
    masked_mean,
    masked_sum,
    sequence_log_ratio,
)

__version__ = "0.1.0"

__all__ = [
    "LOG_RATIO_BOUND",
    "Correction",
    "CorrectionResult",
    "LogProbBatch",
    "aggregate_log_ratio",
    "chain",
    "decompose_log_ratio",
    "log_ratio",
    "masked_mean",
    "masked_sum",
    "sequence_log_ratio",
]
