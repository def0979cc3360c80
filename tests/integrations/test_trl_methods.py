"""The TRL adapter's seed-method parts as functions: the sampling recipe TRL hands its engine and its replay in each
engine's filter order (against HF generate's own processed scores), vLLM's top-k parsing, the top-k bounds, σ's
all-reduce across processes and its checkpoint file, and the subclass's argument checks (on a stand-in base)."""

import math
import os
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.divergence import token_kl
from offpolicy.forward_scores import token_scores
from offpolicy.integrations.trl import (
    ENGINE_ORDERS,
    OffPolicyGRPOMixin,
    pad_topk,
    sampled_token_logprobs,
    trl_sampling_recipe,
)
from offpolicy.integrations.trl.replay import ReplayHistory
from offpolicy.perturbation import LayerwisePerturbation, allreduce_sigma_grad, load_alp, save_alp
from offpolicy.rollout.sampling import SamplingConfig, completion_history, process_logits


def _cfg(**kw):
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=None, repetition_penalty=1.0, max_completion_length=8,
                use_vllm=False, generation_kwargs=None)
    return SimpleNamespace(**{**base, **kw})


def test_recipe_from_grpo_config_and_refusals():
    r = trl_sampling_recipe(_cfg(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.2))
    assert (r.temperature, r.top_k, r.top_p, r.min_p, r.repetition_penalty) == (0.7, 5, 0.9, 0.05, 1.2)
    off = trl_sampling_recipe(_cfg(top_k=-1))  # TRL's "off" values: top_k 0 / −1, top_p 1, min_p None / 0
    assert off.processors == ()
    vllm = trl_sampling_recipe(_cfg(use_vllm=True, generation_kwargs={"frequency_penalty": 0.5, "seed": 3}))
    assert vllm.frequency_penalty == 0.5 and vllm.processors == ("frequency_penalty",)
    with pytest.raises(ValueError, match="frequency_penalty"):  # HF generate has no frequency penalty
        trl_sampling_recipe(_cfg(generation_kwargs={"frequency_penalty": 0.5}))
    with pytest.raises(ValueError, match="typical_p"):
        trl_sampling_recipe(_cfg(generation_kwargs={"typical_p": 0.9}))
    assert ENGINE_ORDERS == {"hf": ("top_k", "top_p", "min_p"), "vllm": ("min_p", "top_k", "top_p")}


def _as_hidden(p):
    """h = 1, W = log p: the logits of the single row are log p."""
    return torch.ones(1, 1), torch.tensor(p).log()[:, None]


def test_engine_orders_differ_by_hand():
    # p = (0.5, 0.3, 0.1, 0.1), min_p 0.5 (keep p ≥ 0.25), top_p 0.6
    # HF (top-p, then min-p): ascending cumsum 0.1, 0.2, 0.5, 1.0; drop ≤ 0.4 → {0, 1}; min-p keeps {0, 1}
    #   log π(1) = log(0.3 / 0.8) = −0.9808, retained mass 0.8
    # vLLM (min-p, then top-p): {0, 1} renormalised (0.625, 0.375); ascending cumsum 0.375 ≤ 0.4 → {0}: token 1 out
    h, w = _as_hidden([0.5, 0.3, 0.1, 0.1])
    recipe = SamplingConfig(min_p=0.5, top_p=0.6)
    hf = token_scores(torch.tensor([1]), hidden=h, weight=w, recipe=recipe, order=ENGINE_ORDERS["hf"])
    vllm = token_scores(torch.tensor([1]), hidden=h, weight=w, recipe=recipe, order=ENGINE_ORDERS["vllm"])
    assert hf.inside.tolist() == [True] and vllm.inside.tolist() == [False]
    assert hf.logp.item() == pytest.approx(math.log(0.3 / 0.8), abs=1e-6)
    assert hf.mass.item() == pytest.approx(0.8, abs=1e-6)
    with pytest.raises(ValueError, match="order"):
        token_scores(torch.tensor([1]), hidden=h, weight=w, recipe=recipe, order=("top_k", "min_p"))


def test_min_p_only_is_the_fused_dvp_kernel_by_hand():
    # DVP at ρ = 0.25 on p = (0.5, 0.3, 0.1, 0.1): safe set {0, 1} (p ≥ 0.125); log π^mp(0) = log(0.5 / 0.8)
    h, w = _as_hidden([0.5, 0.3, 0.1, 0.1])
    r = token_scores(torch.tensor([0, 2]), hidden=h.repeat(2, 1), weight=w, recipe=SamplingConfig(min_p=0.25))
    assert r.logp[0].item() == pytest.approx(math.log(0.5 / 0.8), abs=1e-6)
    assert r.inside.tolist() == [True, False] and r.mass.tolist() == pytest.approx([0.8, 0.8], abs=1e-6)


def _problem(seed=0, n_prompts=2, t=5, vocab=11, hidden=6):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n_prompts * t, hidden, generator=g, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=g, requires_grad=True)
    y = torch.randint(0, vocab, (n_prompts, t), generator=g)
    return h, w, y


def test_replay_with_penalty_equals_the_reference_recipe_and_chunking_changes_nothing():
    # every position scored at once through offpolicy.rollout.sampling (the reference trainer's recipe) against the
    # chunked, checkpointed replay: same values and gradients, whatever the memory budget
    h, w, y = _problem()
    recipe = SamplingConfig(temperature=0.7, top_k=6, top_p=0.9, min_p=0.05, repetition_penalty=1.3)
    prompts = [[1, 2], [3, 3, 4]]
    hist = completion_history(prompts, y.tolist(), w.shape[0], recipe)
    z = (h @ w.T).reshape(2, 5, -1)
    want = process_logits(z, recipe, hist).gather(-1, y[..., None])[..., 0]
    rows = torch.arange(10)
    history = ReplayHistory(prompts, y, torch.ones_like(y), rows)
    results = []
    for budget in (2**30, 11 * 4 * 8):  # one chunk; one row per chunk
        got = token_scores(y.reshape(-1), hidden=h, weight=w, recipe=recipe, order=ENGINE_ORDERS["hf"], history=history,
                          memory_budget_bytes=budget)
        finite = torch.isfinite(want.reshape(-1))
        assert torch.equal(got.inside, finite)
        torch.testing.assert_close(got.logp[finite], want.reshape(-1)[finite])
        (gh, gw) = torch.autograd.grad(got.logp[finite].sum(), (h, w))
        results.append((got.logp.detach(), gh, gw))
    for a, b in zip(results[0], results[1]):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="history"):
        token_scores(y.reshape(-1), hidden=h, weight=w, recipe=recipe)


def test_replay_equals_hf_generates_own_processed_scores():
    # HF generate with left padding, repetition penalty, temperature, top-k, top-p, min-p: the processed scores it
    # sampled from (output_scores) at the sampled tokens == the replay from the trainer's hidden states, with the
    # padded prompt as the history (HF's repetition penalty sees the pad tokens too)
    from transformers import GenerationConfig

    from offpolicy.models.tiny import build_tiny_model

    model, tok = build_tiny_model(seed=0)
    recipe = SamplingConfig(temperature=0.7, top_k=20, top_p=0.95, min_p=0.02, repetition_penalty=1.5)
    prompts = [tok("12+3=")["input_ids"], tok("7=")["input_ids"]]
    width = max(map(len, prompts))
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(0)
    gen = GenerationConfig(max_new_tokens=6, do_sample=True, temperature=0.7, top_k=20, top_p=0.95, min_p=0.02,
                           repetition_penalty=1.5, pad_token_id=pad, eos_token_id=None)
    out = model.generate(input_ids=ids, attention_mask=att, generation_config=gen, output_scores=True,
                         return_dict_in_generate=True)
    completion = out.sequences[:, width:]
    hf_logp = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1).gather(-1, completion[..., None])[..., 0]
    with torch.no_grad():
        full = torch.cat([ids, completion], 1)
        hidden = model.model(input_ids=full, attention_mask=torch.cat([att, torch.ones_like(completion)], 1))
        h = hidden.last_hidden_state[:, width - 1:-1].reshape(-1, model.config.hidden_size)
        history = ReplayHistory(ids.tolist(), completion, torch.ones_like(completion), torch.arange(completion.numel()))
        got = token_scores(completion.reshape(-1), hidden=h, weight=model.lm_head.weight, recipe=recipe, order=ENGINE_ORDERS["hf"],
                          history=history)
    assert bool(got.inside.all())  # HF sampled every token from inside the replayed support
    torch.testing.assert_close(got.logp.reshape(completion.shape), hf_logp, atol=1e-5, rtol=0)  # measured 5e-7


def test_sampled_token_logprobs_takes_the_sampled_entry_not_the_top1():
    # K = 2: position 0 samples the top-1; position 1 samples the rank-2 token; position 2 one outside the top-2
    lps = [[[-0.1, -3.0], [-0.4, -1.2], [-0.2, -0.9, -5.0]]]
    ids = [[[3, 1], [2, 6], [4, 0, 9]]]
    sampled, top_lp, top_ids = sampled_token_logprobs(lps, ids, [[3, 6, 9]], 2)
    assert sampled == [[-0.1, -1.2, -5.0]]  # TRL 1.16 would keep [-0.1, -0.4, -0.2]
    assert top_lp == [[[-0.1, -3.0], [-0.4, -1.2], [-0.2, -0.9]]] and top_ids == [[[3, 1], [2, 6], [4, 0]]]
    nan_sampled, nan_top, _ = sampled_token_logprobs([[[None, -2.0]]], [[[5, 7]]], [[5]], 2)
    assert math.isnan(nan_sampled[0][0]) and nan_top == [[[-math.inf, -2.0]]]
    with pytest.raises(ValueError, match="completion 0 position 1"):
        sampled_token_logprobs(lps, ids, [[3, 5, 9]], 2)
    with pytest.raises(ValueError, match="k must"):
        sampled_token_logprobs(lps, ids, [[3, 6, 9]], 0)
    lp, tid = pad_topk(top_lp, top_ids, 4, 2)
    assert lp.shape == tid.shape == (1, 4, 2)
    assert all(len(set(r.tolist())) == 2 for r in tid.reshape(-1, 2))  # unique ids per position


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 6), temperature=st.sampled_from([0.7, 1.0]))
def test_topk_bounds_bracket_the_exact_kl(seed, k, temperature):
    g = torch.Generator().manual_seed(seed)
    h, w = torch.randn(3, 5, generator=g), torch.randn(7, 5, generator=g)
    mu_logits = h @ w.T + 0.5 * torch.randn(3, 7, generator=g)
    mu = torch.log_softmax(mu_logits, -1)
    top_lp, top_ids = mu.topk(k, -1)
    s = token_scores(torch.zeros(3, dtype=torch.long), hidden=h, weight=w, temperature=temperature,
                     topk=(top_lp, top_ids), bounds=True)
    lower, upper = s.kl_lower, s.kl_upper
    exact = token_kl(mu, h @ w.T, temperature=temperature)  # μ's log-probs, π at the temperature
    assert bool((lower <= exact + 1e-5).all()) and bool((exact <= upper + 1e-5).all())


def _sigma_worker(rank, world, path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        alp = LayerwisePerturbation(torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Identity(), torch.nn.Identity()])))
        if rank == 0:
            alp.log_sigma.grad = torch.tensor([1.0, 4.0])
        # rank 1 has no gradient (no valid token): it contributes zeros, nobody waits forever
        assert allreduce_sigma_grad(alp)
        torch.save(alp.log_sigma.grad, f"{path}.{rank}")
    finally:
        dist.destroy_process_group()


def test_sigma_grad_is_averaged_over_two_gloo_processes(tmp_path):
    import torch.multiprocessing as mp

    path = str(tmp_path / "store")
    mp.start_processes(_sigma_worker, args=(2, path), nprocs=2, join=True, start_method="fork")  # no pickling
    for rank in range(2):  # mean of (1, 4) and (0, 0)
        assert torch.load(f"{path}.{rank}").tolist() == [0.5, 2.0]


def test_alp_checkpoint_round_trip(tmp_path):
    net = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Identity()]))
    alp = LayerwisePerturbation(net, init_std=0.1, seed=3)
    alp._noisy(torch.zeros(2), 0)  # advances the private generator
    with torch.no_grad():
        alp.log_sigma.fill_(-1.5)
    save_alp(alp, tmp_path)
    other = LayerwisePerturbation(torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Identity()])), seed=3)
    load_alp(other, tmp_path)
    assert other.log_sigma.tolist() == [-1.5]
    assert torch.equal(other._noisy(torch.zeros(2), 0), alp._noisy(torch.zeros(2), 0))  # same noise stream
    os.remove(tmp_path / "offpolicy_alp.pt")
    with pytest.raises(ValueError, match="resume_from_checkpoint"):
        load_alp(other, tmp_path, setting="resume_from_checkpoint")


class _StandIn:
    def __init__(self, *a, args=None, **kw):
        self.args = args or SimpleNamespace(use_vllm=False, beta=0.0, epsilon=0.2, epsilon_high=0.28, min_p=None,
                                            temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}


class _Trainer(OffPolicyGRPOMixin, _StandIn):
    """The mixin in front of the stand-in, as ``OffPolicyGRPOTrainer`` is in front of ``GRPOTrainer``."""


def test_subclass_argument_checks():
    cls = _Trainer
    with pytest.raises(ValueError, match="dvp_rho"):
        cls(dvp_rho=0.0)
    with pytest.raises(ValueError, match="dvp_rho: pass args"):
        cls(dvp_rho=0.1)
    with pytest.raises(ValueError, match="topk_logprobs: only vLLM"):
        cls(topk_logprobs=4)
    with pytest.raises(ValueError, match="topk_bound"):
        cls(topk_bound="exact")
    with pytest.raises(ValueError, match="alp has unknown keys"):
        cls(alp={"sigma": 1.0})
    # DVP copies the config with min_p = max(min_p, ρ) and turns the replay on; the user's config is untouched
    user = SimpleNamespace(**vars(_StandIn().args))
    trainer = cls(args=user, dvp_rho=0.05)
    assert trainer.args.min_p == 0.05 and user.min_p is None
    assert trainer.offpolicy_recipe.min_p == 0.05 and trainer.offpolicy_order == ENGINE_ORDERS["hf"]


def test_raw_vllm_server_logprobs_are_refused():
    class WithServer(_StandIn):
        def __init__(self, *a, mode="raw_logprobs", **kw):
            super().__init__(args=SimpleNamespace(use_vllm=True, vllm_mode="server", beta=0.0, epsilon=0.2,
                                                  vllm_importance_sampling_correction=False))
            info = {"model_config": {"logprobs_mode": mode}}
            self.vllm_generation = SimpleNamespace(vllm_client=SimpleNamespace(get_server_info=lambda: info))

    cls = type("WithServerTrainer", (OffPolicyGRPOMixin, WithServer), {})
    with pytest.raises(ValueError, match="logprobs_mode"):
        cls()
    cls(mode="processed_logprobs")


def test_heads_that_scale_or_softcap_and_alp_on_logits_are_refused():
    from offpolicy.integrations.trl.parts.scoring import _check_plain_head

    with pytest.raises(ValueError, match="final_logit_softcapping"):
        _check_plain_head(SimpleNamespace(config=SimpleNamespace(final_logit_softcapping=30.0)))
    _check_plain_head(SimpleNamespace(config=SimpleNamespace(final_logit_softcapping=None, logit_scale=1.0)))
    cls = _Trainer
    with pytest.raises(ValueError, match="layers='logits'"):
        cls(alp={"layers": "logits"})
