"""Shared fixtures of the framework tests: a stub of TRL's vLLM server client (a live vLLM cannot run here).

The suite imports test modules by path (``--import-mode=importlib``), so what several files use lives here."""

import pytest
import torch
from offpolicy_testkit.vllm_layout import vllm_logprob_lists

from offpolicy.rollout.sampling import SamplingConfig


class StubVLLMClient:
    """TRL's ``VLLMClient`` as ``trl vllm-serve`` answers it, backed by offpolicy's HF rollout engine in bfloat16
    (a real numeric mismatch with the fp32 trainer; ``logit_noise`` adds the engine's seeded logit noise for a larger
    one): weights pushed by ``update_named_params``, completions with vLLM's log-prob layout (``logprobs=0``: the
    sampled token's alone; K > 0: the top-K by rank, plus the sampled token when it is not among them)."""

    def __init__(self, model, tok, logprobs_mode="processed_logprobs", logit_noise=0.0):
        from offpolicy.rollout.hf import HFRolloutEngine

        self.engine = HFRolloutEngine(model, tokenizer=tok, logit_noise=logit_noise)
        self.mode = logprobs_mode
        self.synced: list[str] = []
        self.sampled: list[list[float]] = []
        self.top1: list[list[float]] = []

    def get_server_info(self):
        return {"model_config": {"logprobs_mode": self.mode}}

    def update_named_params(self, metadata, params):
        own = dict(self.engine.model.named_parameters())
        for name, value in params:
            self.synced.append(name)
            with torch.no_grad():
                own[name].copy_(value)

    def reset_prefix_cache(self):
        pass

    def get_sequence_logprobs(self, sequences, prompt_lengths, top_logprobs=100, temperature=1.0, **kwargs):
        """The engine's teacher-forced log-probs of each sequence's completion (what the sync check reads), in
        TRL's ``actual_logprobs`` layout ``(B, T_i, 1)``."""
        prompts = [list(s[:n]) for s, n in zip(sequences, prompt_lengths)]
        completions = [list(s[n:]) for s, n in zip(sequences, prompt_lengths)]
        logp = self.engine.score(prompts, completions)[0]
        return {"actual_logprobs": [[[float(v)] for v in logp[i, :len(c)]] for i, c in enumerate(completions)]}

    def generate(self, prompts, features=None, n=1, repetition_penalty=1.0, temperature=1.0, top_p=1.0, top_k=0,
                 min_p=0.0, max_tokens=16, logprobs=0, structured_outputs_regex=None, generation_kwargs=None):
        k = int(logprobs or 0)
        cfg = SamplingConfig(max_new_tokens=max_tokens, temperature=temperature, top_k=top_k or None,
                             top_p=top_p if top_p < 1 else None, min_p=min_p or None, logprobs_topk=max(k, 1))
        rows = [p for p in prompts for _ in range(n)]
        out = self.engine.generate(rows, cfg, seed=len(self.sampled))
        lps, ids = vllm_logprob_lists(out, k)  # vLLM's layout: the top-K, then the sampled token when not in it
        for i, completion in enumerate(out.completion_ids):
            self.sampled.append(out.logp[i, : len(completion)].tolist())
            self.top1.append(out.topk_logp[i, : len(completion), 0].tolist())
        return {"prompt_ids": prompts, "completion_ids": out.completion_ids, "logprobs": lps, "logprob_token_ids": ids}


@pytest.fixture
def stub_vllm(monkeypatch):
    """Put ``holder["client"]`` (a :class:`StubVLLMClient`) in place of TRL's ``VLLMClient``."""
    vg = pytest.importorskip("trl.generation.vllm_generation")

    holder = {}

    def init(self):
        self.vllm_client = holder["client"]

    monkeypatch.setattr(vg.VLLMGeneration, "_init_vllm", init)
    return holder


@pytest.fixture
def stub_vllm_client():
    """The :class:`StubVLLMClient` class (``StubVLLMClient(model, tok, logprobs_mode=...)``)."""
    return StubVLLMClient
