"""TRL 1.16's own GRPO options under ``OffPolicyGRPOTrainer``: TRL's real ``train()`` with each option, vanilla
``GRPOTrainer`` beside the subclass with no correction, from the same seed on the embedded tiny random Qwen2 — the
same logged loss and the same TRL metrics (``entropy``, ``kl``, ``clip_ratio/…``, ``aux_loss`` …), step by step.

Options: the KL to the reference (``beta``, ``sync_ref_model``, ``use_bias_correction_kl``), the entropy bonus (static,
adaptive), sequence-level IS, every TRL loss type (CISPO with TRL's default ``epsilon_high=None`` too), the entropy
filter, TRL's off-policy mask, TRL's vLLM IS correction (a stub vLLM server), a mixture-of-experts model's router
loss. ``num_iterations=2`` where a ratio matters: the second step reuses the batch, so π_θ ≠ π_old and the clips,
caps and masks act. Skipped when TRL 1.16 is not installed."""

import math

import pytest
import torch

from offpolicy.models.tiny import build_tiny_model

pytestmark = pytest.mark.slow
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
if not trl.__version__.startswith("1.16"):
    pytest.skip(f"compares with TRL 1.16's own loss; installed {trl.__version__}", allow_module_level=True)

from offpolicy_testkit.trl_toy import loss_and_grad  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from offpolicy.integrations.trl import OffPolicyGRPOTrainer  # noqa: E402

# logged per step by TRL and not a function of the numbers (wall-clock)
_TIMING = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


def _data():
    return datasets.Dataset.from_list([{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(8)])


def _reward(completions, answer, **kwargs):
    """Varies within a group, so that the advantages (and the gradients) are not all zero."""
    return [float(len(c)) % 3 + float(c.strip().startswith(a)) for c, a in zip(completions, answer)]


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
                max_steps=2, report_to=[], use_cpu=True, bf16=False, logging_steps=1, save_strategy="no", beta=0.0,
                seed=0)
    return GRPOConfig(**{**base, **kw})


def _train(cls, tmp_path, model_fn=None, stub=None, **kw):
    trainer_kw = {k: kw.pop(k) for k in list(kw) if k in ("correction", "sampling_replay", "sync_check")}
    torch.manual_seed(0)
    model, tok = (model_fn or (lambda: build_tiny_model(seed=0)))()
    if stub is not None:  # a fresh stub server per run: its seeds restart
        stub[0]["client"] = stub[1](model, tok)
    trainer = cls(model=model, reward_funcs=_reward, args=_args(tmp_path, **kw), train_dataset=_data(),
                  processing_class=tok, **trainer_kw)
    trainer.train()
    return trainer


def _steps(trainer):
    return [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]


def _same_run(vanilla, ours, must_log=()):
    """Every number vanilla TRL logged, step by step, logged alike by the subclass (to float error)."""
    theirs, mine = _steps(vanilla), _steps(ours)
    assert len(theirs) == len(mine) == vanilla.args.max_steps
    for key in must_log:
        assert all(key in h for h in theirs), (key, theirs[0].keys())
    for step, (a, b) in enumerate(zip(theirs, mine)):
        for key, value in a.items():
            if key in _TIMING or not isinstance(value, (int, float)):
                continue
            assert key in b, (step, key)
            if math.isnan(value):
                assert math.isnan(b[key]), (step, key)
            else:
                assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (step, key, value, b[key])
    return theirs, mine


def _saved_model(tmp_path):
    """The tiny model loaded from a folder: TRL builds the reference model from the policy's path."""
    model, tok = build_tiny_model(seed=0)
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return lambda: (str(folder), tok)


@pytest.mark.parametrize("extra", [
    {},
    {"use_bias_correction_kl": True, "num_iterations": 2},
    {"sync_ref_model": True, "ref_model_sync_steps": 1, "ref_model_mixup_alpha": 0.5},
], ids=["k3", "bias-corrected", "sync_ref_model"])
def test_kl_to_the_reference_model(tmp_path, extra):
    # beta ≠ 0: TRL scores a reference model and adds β·KL (k3) after the masks; kl logged under TRL's name
    model_fn = _saved_model(tmp_path)
    kw = dict(beta=0.1, **extra)
    vanilla = _train(GRPOTrainer, tmp_path, model_fn, **kw)
    ours = _train(OffPolicyGRPOTrainer, tmp_path, model_fn, **kw)
    theirs, _ = _same_run(vanilla, ours, must_log=("kl", "entropy"))
    assert theirs[-1]["kl"] > 0  # the policy moved away from the reference: the term is live


def test_kl_under_sampling_replay(tmp_path):
    # the reference model is scored through the replay too (temperature only: TRL's own numbers)
    model_fn = _saved_model(tmp_path)
    kw = dict(beta=0.1, temperature=0.7, num_iterations=2)
    vanilla = _train(GRPOTrainer, tmp_path, model_fn, **kw)
    ours = _train(OffPolicyGRPOTrainer, tmp_path, model_fn, sampling_replay=True, **kw)
    _same_run(vanilla, ours, must_log=("kl", "entropy"))


@pytest.mark.parametrize("extra", [
    {"entropy_coef": 0.05},
    # adaptive: the target above the entropy (the coefficient grows) and below it (it shrinks, the bonus gated off)
    {"use_adaptive_entropy": True, "entropy_coef": 0.01, "entropy_target": 100.0, "entropy_coef_delta": 0.02,
     "gradient_accumulation_steps": 2, "per_device_train_batch_size": 2},
    {"use_adaptive_entropy": True, "entropy_coef": 0.05, "entropy_target": 0.0, "entropy_coef_delta": 0.02},
], ids=["static", "adaptive-up", "adaptive-down"])
def test_entropy_bonus(tmp_path, extra):
    vanilla = _train(GRPOTrainer, tmp_path, **extra)
    ours = _train(OffPolicyGRPOTrainer, tmp_path, **extra)
    theirs, _ = _same_run(vanilla, ours, must_log=("entropy", "entropy_coef", "policy_loss"))
    assert ours.entropy_coef == pytest.approx(vanilla.entropy_coef)
    if extra.get("use_adaptive_entropy"):
        assert theirs[-1]["entropy_coef"] != pytest.approx(extra["entropy_coef"])  # the controller moved it


@pytest.mark.parametrize("loss_type, extra", [
    ("grpo", {}), ("bnpo", {}), ("dr_grpo", {}), ("dapo", {}), ("sapo", {}),
    ("cispo", {}),  # TRL's default epsilon_high=None: the cap is epsilon (0.2)
    ("cispo", {"epsilon_high": 1.05}),
    ("grpo", {"importance_sampling_level": "sequence"}),
    ("luspo", {"importance_sampling_level": "sequence"}),
    ("vespo", {}),
    ("dapo", {"delta": 1.02, "epsilon_high": 0.28}),
], ids=lambda x: x if isinstance(x, str) else "-".join(f"{k}={v}" for k, v in x.items()) or "default")
def test_every_loss_type(tmp_path, loss_type, extra):
    kw = dict(loss_type=loss_type, num_iterations=2, learning_rate=1e-3, **extra)
    vanilla = _train(GRPOTrainer, tmp_path, **kw)
    ours = _train(OffPolicyGRPOTrainer, tmp_path, **kw)
    names = {"cispo": ("cispo_clip_ratio",), "vespo": ("vespo/phi_seq_mean",), "sapo": ()}
    _same_run(vanilla, ours, must_log=("entropy", *names.get(loss_type, ("clip_ratio/region_mean",
                                                                         "clip_ratio/high_max"))))


@pytest.mark.parametrize("extra", [
    {"top_entropy_quantile": 0.5},
    {"off_policy_mask_threshold": 0.001, "num_iterations": 2, "learning_rate": 1e-3},
], ids=["entropy-filter", "off-policy-mask"])
def test_masks(tmp_path, extra):
    vanilla = _train(GRPOTrainer, tmp_path, **extra)
    ours = _train(OffPolicyGRPOTrainer, tmp_path, **extra)
    theirs, _ = _same_run(vanilla, ours, must_log=("entropy",))
    # the mask is live: without it the same run logs another loss
    unmasked = _train(GRPOTrainer, tmp_path, **{k: v for k, v in extra.items()
                                               if k not in ("top_entropy_quantile", "off_policy_mask_threshold")})
    assert any(a["loss"] != pytest.approx(b["loss"], rel=1e-3) for a, b in zip(theirs, _steps(unmasked)))


def test_trls_vllm_importance_sampling_and_its_contradiction(tmp_path, stub_vllm, stub_vllm_client):
    # TRL's default vLLM IS correction (sequence_mask at 3.0) on a stub server with a bf16 engine: kept as TRL applies
    # it when no correction is given; with correction= too the mismatch would be corrected twice: refused
    stub = (stub_vllm, stub_vllm_client)
    kw = dict(use_vllm=True, vllm_mode="server", vllm_importance_sampling_mode="token_truncate")
    vanilla = _train(GRPOTrainer, tmp_path, stub=stub, **kw)
    ours = _train(OffPolicyGRPOTrainer, tmp_path, stub=stub, sync_check=None, **kw)
    _same_run(vanilla, ours, must_log=("sampling/importance_sampling_ratio/mean", "entropy"))
    with pytest.raises(ValueError, match="correction=.*vllm_importance_sampling_correction"):
        _train(OffPolicyGRPOTrainer, tmp_path, stub=stub, correction="icepop", **kw)


def _tiny_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    _, tok = build_tiny_model(seed=0)
    config = Qwen2MoeConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                            shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, output_router_logits=True,
                            router_aux_loss_coef=0.01, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                            bos_token_id=tok.bos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(config), tok


def test_mixture_of_experts_router_loss(tmp_path):
    # a tiny random Qwen2-MoE (no download): TRL adds router_aux_loss_coef · aux to the loss and logs aux_loss
    vanilla = _train(GRPOTrainer, tmp_path, _tiny_moe)
    ours = _train(OffPolicyGRPOTrainer, tmp_path, _tiny_moe)
    assert vanilla.aux_loss_enabled and ours.aux_loss_enabled
    theirs, _ = _same_run(vanilla, ours, must_log=("aux_loss", "entropy"))
    assert all(h["aux_loss"] > 0 for h in theirs)


def test_entropy_under_sampling_replay(tmp_path):
    # temperature only: the replayed support is the whole vocabulary, so the entropy is TRL's (the same run); with
    # top-k the entropy is the replayed support's — lower than the full one — and the bonus trains through it
    kw = dict(temperature=0.7, entropy_coef=0.05)
    vanilla = _train(GRPOTrainer, tmp_path, **kw)
    ours = _train(OffPolicyGRPOTrainer, tmp_path, sampling_replay=True, **kw)
    _same_run(vanilla, ours, must_log=("entropy",))
    truncated = _train(OffPolicyGRPOTrainer, tmp_path, sampling_replay=True, top_k=5, **kw)
    full = [h["entropy"] for h in _steps(vanilla)]
    replayed = [h["entropy"] for h in _steps(truncated)]
    assert all(0 < r < math.log(5) + 1e-6 for r in replayed) and replayed[0] < full[0]


def test_contradictions_name_both_settings(tmp_path):
    model, tok = build_tiny_model(seed=0)
    with pytest.raises(ValueError, match="importance_sampling_level='sequence' with loss_type='sapo'"):
        OffPolicyGRPOTrainer(model=model, reward_funcs=_reward, args=_args(tmp_path, loss_type="sapo",
                             importance_sampling_level="sequence"), train_dataset=_data(), processing_class=tok)


@pytest.mark.parametrize("recipe_kw", [dict(top_k=3), dict(top_p=0.8, min_p=0.05), dict(repetition_penalty=1.5)])
def test_replay_entropy_equals_the_support_distribution_token_by_token(recipe_kw):
    # H(π_S) from the chunked kernel == −Σ_{a∈S} π_S(a) log π_S(a) with π_S(a) the replayed log-prob of every token a
    # (the loss's own path), value and gradient; chunks of one row
    from offpolicy.forward_scores import token_scores
    from offpolicy.integrations.trl.replay import ENGINE_ORDERS, ReplayHistory
    from offpolicy.rollout.sampling import SamplingConfig

    g = torch.Generator().manual_seed(0)
    n, hid, vocab = 4, 5, 7
    hidden = torch.randn(n, hid, generator=g, requires_grad=True)
    weight = torch.randn(vocab, hid, generator=g)
    recipe = SamplingConfig(temperature=0.8, **recipe_kw)
    history = None
    if recipe.reads_history:
        history = ReplayHistory([[1, 2], [3]], torch.tensor([[4, 4], [5, 0]]), torch.tensor([[1, 1], [1, 1]]),
                                torch.arange(n))
    order = ENGINE_ORDERS["vllm"]
    got = token_scores(torch.zeros(n, dtype=torch.long), hidden=hidden, weight=weight, recipe=recipe, order=order,
                       history=history, entropy=True, entropy_grad=True, memory_budget_bytes=4 * vocab * 8).entropy
    want = torch.zeros(n)
    for a in range(vocab):
        hist = None if history is None else ReplayHistory(history.prompts, history.completion_ids,
                                                          history.completion_mask, history.rows)
        r = token_scores(torch.full((n,), a), hidden=hidden, weight=weight, recipe=recipe, order=order, history=hist)
        want = want - torch.where(r.inside, r.logp.exp() * r.logp, 0.0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert bool((got >= 0).all()) and bool((got <= math.log(recipe.top_k or vocab) + 1e-6).all())
    g_got = torch.autograd.grad(got.sum(), hidden)[0]
    g_want = torch.autograd.grad(want.sum(), hidden)[0]
    torch.testing.assert_close(g_got, g_want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("loss_type, accumulation, extra", [
    ("luspo", 2, {"importance_sampling_level": "sequence"}),
    ("vespo", 4, {"steps_per_generation": 4}),
    ("cispo", 4, {"steps_per_generation": 4}),  # epsilon_high=None: the cap is 0.2
    ("bnpo", 2, {"delta": 1.1}),
    ("grpo", 2, {"top_entropy_quantile": 0.5, "off_policy_mask_threshold": 0.05}),
    ("dapo", 4, {"entropy_coef": 0.1, "steps_per_generation": 4}),
    ("grpo", 2, {"importance_sampling_level": "sequence", "entropy_coef": 0.1, "top_entropy_quantile": 0.7}),
])
def test_compute_loss_value_and_gradient_equal_trls(tmp_path, loss_type, accumulation, extra):
    # the same trainer and inputs through TRL's _compute_loss and the subclass's: value and parameter gradient, with
    # π_old = π_θ + 0.3·N(0, 1) (the ratios spread over the clips, caps and masks) and unequal completion lengths
    import functools

    torch.manual_seed(0)
    model, tok = build_tiny_model(seed=0)
    args = _args(tmp_path, per_device_train_batch_size=8, max_completion_length=8, loss_type=loss_type, **extra)
    trainer = OffPolicyGRPOTrainer(model=model, reward_funcs=_reward, args=args, train_dataset=_data(),
                                   processing_class=tok)
    trainer.model.train()
    torch.manual_seed(1)
    inputs = trainer._generate_and_score_completions([_data()[i] for i in range(2)] * 4)
    t = inputs["completion_mask"].shape[1]
    lengths = torch.tensor([8, 3, 5, 2, 7, 4, 6, 1]).clamp(max=t)
    inputs["completion_mask"] = (torch.arange(t)[None, :] < lengths[:, None]).long()
    with torch.no_grad():
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        current = trainer._get_per_token_logps_and_entropies(trainer.model, ids, att, t)[0]
    noise = 0.3 * torch.randn(current.shape, generator=torch.Generator().manual_seed(3))
    inputs["old_per_token_logps"] = current + noise
    inputs["num_items_in_batch"] = 4 * inputs["completion_mask"].sum()
    trainer.current_gradient_accumulation_steps = accumulation

    theirs, g_theirs = loss_and_grad(trainer, functools.partial(GRPOTrainer._compute_loss, trainer), inputs)
    logged_theirs = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    ours, g_ours = loss_and_grad(trainer, trainer._compute_loss, inputs)
    logged_ours = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    assert ((g_ours - g_theirs).norm() / g_theirs.norm()).item() < 1e-5
    for key, value in logged_theirs.items():
        if key != "entropy_coef":  # logged at optimiser-step boundaries; both appended the same value
            assert logged_ours[key] == pytest.approx(value, rel=1e-5, abs=1e-7, nan_ok=True), key


def test_kl_and_weight_properties():
    # k3 ≥ 0 with equality iff π_θ = π_ref, its value at hand-computed points; the sequence weight is the mean log
    # ratio over the mask (padding ignored)
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from offpolicy.integrations.trl.terms import kl_to_reference, trl_log_weight

    @settings(max_examples=50, deadline=None)
    @given(st.lists(st.floats(-8, 0), min_size=2, max_size=6), st.lists(st.floats(-8, 0), min_size=2, max_size=6))
    def check(a, b):
        n = min(len(a), len(b))
        logp, ref = torch.tensor([a[:n]], dtype=torch.float64), torch.tensor([b[:n]], dtype=torch.float64)
        kl = kl_to_reference(logp, ref)
        assert bool((kl >= 0).all()) and bool((kl[logp == ref] == 0).all())
        far = (logp - ref).abs() > 1e-3  # away from 0, where e^d − d − 1 ≈ d²/2 is above rounding
        assert bool((kl[far] > 0).all())
        mask = torch.ones(1, n)
        mask[0, -1] = 0
        want = (logp - ref)[0, :-1].mean()
        torch.testing.assert_close(trl_log_weight(logp, ref, mask, "sequence")[0, 0], want)

    check()
    # d = log π_ref − log π_θ = 1: e − 2 = 0.71828; d = −1: e^{-1} = 0.36788
    got = kl_to_reference(torch.tensor([[-2.0, -1.0]]), torch.tensor([[-1.0, -2.0]]))
    torch.testing.assert_close(got, torch.tensor([[0.71828, 0.36788]]), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        trl_log_weight(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), "geometric")
