"""Rollout engines that sample and report processed log-probs (μ), and the trainer-side scorer (π_old)."""

from offpolicy.rollout.base import RolloutEngine, RolloutOutput, check_prompt_ids, pad_ids
from offpolicy.rollout.hf import HFRolloutEngine, fake_quantize
from offpolicy.rollout.sampling import SamplingConfig, process_logits, sample_tokens, topk_logprobs
from offpolicy.rollout.scoring import sequence_logprobs
from offpolicy.rollout.vllm import VLLMRolloutEngine

__all__ = [
    "HFRolloutEngine",
    "RolloutEngine",
    "RolloutOutput",
    "SamplingConfig",
    "VLLMRolloutEngine",
    "check_prompt_ids",
    "fake_quantize",
    "pad_ids",
    "process_logits",
    "sample_tokens",
    "sequence_logprobs",
    "topk_logprobs",
]
