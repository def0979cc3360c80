"""vLLM's log-prob layout, for stubs of vLLM: the tests' stand-in for TRL's ``VLLMClient`` and the TRL benchmark's
engine client answer in it (the implementation stays private in the library while its deprecated public name
lasts)."""

from __future__ import annotations

from offpolicy.integrations.trl.rollout import _vllm_logprob_lists as vllm_logprob_lists

__all__ = ["vllm_logprob_lists"]
