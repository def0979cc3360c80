"""Rollout engines that sample and report processed log-probs (μ), and the trainer-side scorer (π_old).

Every engine is built by one factory from an :class:`EngineSpec` (:func:`build_engine`); a backend is added with
:func:`register_engine` (the built-ins register next to their engines: hf, vllm, llamacpp, servers).
"""

from offpolicy.rollout.base import RolloutEngine, RolloutOutput, check_prompt_ids, pad_ids
from offpolicy.rollout.factory import ENGINE_BUILDERS, EngineBackend, build_engine, engine_backends, register_engine
from offpolicy.rollout.hf import HFRolloutEngine, fake_quantize
from offpolicy.rollout.http import ServerError
from offpolicy.rollout.llamacpp import LlamaCppProtocol, LlamaCppRolloutEngine, LlamaCppServer, connect_llamacpp
from offpolicy.rollout.protocols import SGLangProtocol, VLLMProtocol
from offpolicy.rollout.quant_formats import QUANT_FORMATS, QuantFormat, quant_format
from offpolicy.rollout.routing import RouteRecorder, find_routers, replay_routes, split_routes
from offpolicy.rollout.sampling import (
    SamplingConfig,
    TokenHistory,
    completion_history,
    inverse_cdf,
    process_logits,
    sample_tokens,
    topk_logprobs,
)
from offpolicy.rollout.scoring import sequence_logprobs
from offpolicy.rollout.server_engine import ServerRolloutEngine
from offpolicy.rollout.servers import connect_server
from offpolicy.rollout.spec import EngineSpec
from offpolicy.rollout.vllm import VLLMRolloutEngine

__all__ = [
    "ENGINE_BUILDERS",
    "EngineBackend",
    "EngineSpec",
    "HFRolloutEngine",
    "LlamaCppProtocol",
    "LlamaCppRolloutEngine",
    "LlamaCppServer",
    "QUANT_FORMATS",
    "QuantFormat",
    "RolloutEngine",
    "RolloutOutput",
    "RouteRecorder",
    "SGLangProtocol",
    "ServerError",
    "ServerRolloutEngine",
    "SamplingConfig",
    "TokenHistory",
    "VLLMProtocol",
    "VLLMRolloutEngine",
    "build_engine",
    "check_prompt_ids",
    "completion_history",
    "connect_llamacpp",
    "connect_server",
    "engine_backends",
    "fake_quantize",
    "find_routers",
    "inverse_cdf",
    "pad_ids",
    "process_logits",
    "quant_format",
    "register_engine",
    "replay_routes",
    "sample_tokens",
    "sequence_logprobs",
    "split_routes",
    "topk_logprobs",
]
