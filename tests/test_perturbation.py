"""Adaptive Layerwise Perturbation (arXiv 2603.19470 §3.2): hooks, σ learning, on/off switching, ablations, the ALP loss."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from offpolicy.batch import LogProbBatch
from offpolicy.perturbation import (
    DUAL_CLIP,
    LayerwisePerturbation,
    alp_clip_defaults,
    alp_policy_loss,
    find_decoder_layers,
)


class Identity(nn.Module):
    def forward(self, h: torch.Tensor | None = None, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        return h if h is not None else hidden_states


class Stack(nn.Module):
    """h → layers (identity) → head (identity): the output is input + the sum of the injected noises."""

    def __init__(self, n: int = 3, kwarg: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Identity() for _ in range(n)])
        self.lm_head = Identity()
        self.kwarg = kwarg

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer(hidden_states=h) if self.kwarg else layer(h)
        return self.lm_head(h)


@pytest.fixture(scope="module")
def tiny():
    from offpolicy.models.tiny import build_tiny_model

    model, _ = build_tiny_model(0, num_hidden_layers=2, hidden_size=32, intermediate_size=64)
    return model


def test_finds_hf_decoder_layers(tiny):
    assert find_decoder_layers(tiny) is tiny.model.layers
    assert find_decoder_layers(tiny, "model.layers") is tiny.model.layers
    with pytest.raises(ValueError, match="layers_path"):
        find_decoder_layers(tiny, "model.nope")


def test_noise_off_by_default_and_for_pi_old(tiny):
    alp = LayerwisePerturbation(tiny, init_std=1e-2, seed=0)
    x = torch.randint(0, 100, (2, 6))
    try:
        with torch.no_grad():
            a, b = tiny(x).logits, tiny(x).logits  # π_old-style forwards: unperturbed, bitwise equal
            with alp.active():
                c, d = tiny(x).logits, tiny(x).logits
            e = tiny(x).logits  # state restored after the context
        assert torch.equal(a, b) and torch.equal(a, e)
        assert not torch.equal(a, c)
        assert not torch.equal(c, d)  # fresh noise every forward
    finally:
        alp.remove()


def test_gradient_reaches_log_sigma_and_update_changes_sigma(tiny):
    alp = LayerwisePerturbation(tiny, init_std=1e-2, seed=0)
    try:
        opt = torch.optim.AdamW([alp.param_group(lr=5e-2)])
        x = torch.randint(0, 100, (2, 6))
        with alp.active():
            out = tiny(x).logits.log_softmax(-1)[..., 0].mean()
        out.backward()
        g = alp.log_sigma.grad
        assert g is not None and g.shape == (2,) and torch.isfinite(g).all() and (g != 0).all()
        before = alp.sigma.detach().clone()
        opt.step()
        assert not torch.equal(before, alp.sigma.detach())
    finally:
        alp.remove()
        tiny.zero_grad(set_to_none=True)


def test_hooks_removable_restore_model(tiny):
    x = torch.randint(0, 100, (1, 5))
    with torch.no_grad():
        ref = tiny(x).logits
        alp = LayerwisePerturbation(tiny, init_std=1.0, seed=0)
        alp.enabled(True)
        assert not torch.equal(ref, tiny(x).logits)
        alp.remove()
        alp.remove()  # idempotent
        assert torch.equal(ref, tiny(x).logits)
    assert not alp.is_enabled
    with pytest.raises(ValueError, match="removed"):
        alp.enabled(True)


def test_noise_is_sigma_times_standard_normal_per_layer():
    # Identity layers: out = x + Σ_l σ_l ε_l. With σ = (0.5, 0, 2) → only layers 0 and 2 count; with the same seed the
    # draws are reproducible, so out − x equals 0.5·ε_0 + 2·ε_2 computed from a replay of the generator.
    net = Stack(3)
    alp = LayerwisePerturbation(net, init_std=1.0, seed=7)
    with torch.no_grad():
        alp.log_sigma.copy_(torch.tensor([math.log(0.5), -1e4, math.log(2.0)]))  # exp(-1e4) = 0
    x = torch.zeros(4, 5)
    with alp.active():
        out = net(x)
    g = torch.Generator().manual_seed(7)
    e0, e1, e2 = (torch.randn(4, 5, generator=g) for _ in range(3))
    torch.testing.assert_close(out, 0.5 * e0 + 0.0 * e1 + 2.0 * e2)


def test_seeded_generator_reproducible_and_independent_of_global_rng():
    x = torch.zeros(2, 3)
    outs = []
    for _ in range(2):
        net = Stack(2)
        alp = LayerwisePerturbation(net, init_std=0.1, seed=3)
        torch.manual_seed(len(outs))  # different global RNG each time: must not matter
        with alp.active():
            outs.append(net(x))
    assert torch.equal(outs[0], outs[1])


def test_generator_state_round_trip():
    net = Stack(2)
    alp = LayerwisePerturbation(net, init_std=0.1, seed=3)
    x = torch.zeros(2, 3)
    with alp.active():
        net(x)
        state = alp.generator_states()
        a = net(x)
        alp.set_generator_states(state)
        b = net(x)
    assert torch.equal(a, b)


def test_kwarg_hidden_states_are_perturbed():
    net = Stack(2, kwarg=True)
    alp = LayerwisePerturbation(net, init_std=0.1, seed=0)
    with alp.active():
        assert (net(torch.zeros(2, 3)) != 0).any()


def test_layer_subset_and_logits_only(tiny):
    x = torch.randint(0, 100, (1, 5))
    sub = LayerwisePerturbation(tiny, layers=[-1], init_std=1e-2, seed=0)
    assert sub.layer_indices == (1,) and sub.num_layers == 1
    sub.remove()
    head = LayerwisePerturbation(tiny, layers="logits", init_std=1e-2, seed=0)
    assert head.num_layers == 1 and set(head.metrics()) >= {"alp/sigma_mean", "alp/sigma/logits"}
    with torch.no_grad():
        ref = tiny(x).logits
        with head.active():
            noisy = tiny(x).logits
    head.remove()
    assert not torch.equal(ref, noisy)
    # Logits-only noise enters after the last hidden state only: the decoder's output is untouched.
    net = Stack(2)
    only = LayerwisePerturbation(net, layers="logits", init_std=1.0, seed=1)
    with only.active():
        out = net(torch.zeros(1, 4))
    g = torch.Generator().manual_seed(1)
    torch.testing.assert_close(out, torch.randn(1, 4, generator=g))


def test_logits_only_noise_is_iid_over_the_vocabulary():
    # arXiv 2603.19470 §6.1: "the output logits only (no hidden-state perturbation)". Noise added before a [H=2 → V=6] head
    # would move the logits only inside its rank-2 image; on the head's output the 40 draws span all 6 directions.
    head = nn.Linear(2, 6)
    net = nn.Sequential()
    net.lm_head = head
    alp = LayerwisePerturbation(net, layers="logits", init_std=1.0, seed=0)
    h = torch.randn(1, 2)
    with torch.no_grad():
        clean = net.lm_head(h)
        with alp.active():
            diffs = torch.cat([net.lm_head(h) - clean for _ in range(40)])
    assert torch.linalg.matrix_rank(diffs).item() == 6


def test_decoder_layers_are_the_outermost_list_not_the_experts_of_a_moe_layer():
    class MoELayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList([nn.Linear(2, 2) for _ in range(8)])  # more experts than layers

    class MoEModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.layers = nn.ModuleList([MoELayer() for _ in range(3)])

    m = MoEModel()
    assert find_decoder_layers(m) is m.model.layers
    assert LayerwisePerturbation(m).num_layers == 3


@pytest.mark.parametrize(
    "kwargs, match",
    [({"layers": [5]}, "layers"), ({"layers": []}, "layers"), ({"layers": [0, 0]}, "duplicates"),
     ({"init_std": 0.0}, "init_std"), ({"init_std": float("nan")}, "init_std"), ({"layers": "middle"}, "layers")],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LayerwisePerturbation(Stack(2), **kwargs)


def test_state_dict_holds_only_log_sigma_and_param_group():
    net = Stack(3)
    alp = LayerwisePerturbation(net, init_std=1e-4)
    sd = alp.state_dict()
    assert list(sd) == ["log_sigma"]
    torch.testing.assert_close(sd["log_sigma"], torch.full((3,), math.log(1e-4)))
    assert "log_sigma" not in dict(net.named_parameters())  # the model's own state_dict stays clean
    group = alp.param_group()
    assert group["lr"] == 5e-4 and group["params"][0] is alp.log_sigma and group["weight_decay"] == 0.0
    other = LayerwisePerturbation(Stack(3), init_std=1.0)
    other.load_state_dict(sd)
    torch.testing.assert_close(other.sigma, torch.full((3,), 1e-4))


def test_alp_loss_token_level_hand_computed():
    # logp = (-1, -1), μ = (-1, -2) → r = (1, e). A = +1, clip 0.2/0.28 → r₂ clipped at 1.28.
    # per-token loss = −min(rA, clip(r)A) = (−1, −1.28) → token mean −1.14.
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    b = LogProbBatch(logp=logp, mask=torch.ones(1, 2), rollout_logp=torch.tensor([[-1.0, -2.0]]),
                     old_logp=torch.tensor([[-5.0, -5.0]]), advantages=torch.tensor([1.0]))
    loss, _ = alp_policy_loss(b)  # old_logp must be ignored: unified ratio π/μ only
    assert loss.item() == pytest.approx(-1.14)
    loss.backward()
    # d/dlogp: token 1 r·A = 1 → −1/2; token 2 clipped → 0.
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, 0.0]]))


def test_alp_loss_sequence_level_hand_computed():
    # log r = (0, 1) → geometric ρ = e^{0.5} ≈ 1.6487 within [0.5, 4.0] → unclipped; A = −1 →
    # per-token loss = +1.6487 each, dual clip 10 inactive → mean 1.6487.
    b = LogProbBatch(logp=torch.tensor([[-1.0, -1.0]]), mask=torch.ones(1, 2), rollout_logp=torch.tensor([[-1.0, -2.0]]),
                     advantages=torch.tensor([-1.0]))
    loss, _ = alp_policy_loss(b, level="geometric")
    assert loss.item() == pytest.approx(math.exp(0.5), rel=1e-5)
    # Dual clip: μ much smaller → ρ = e^{5} ≈ 148 > 10, A = −1 → loss bounded at c·|A| = 10.
    b2 = b.replace(rollout_logp=torch.tensor([[-6.0, -6.0]]))
    loss2, m = alp_policy_loss(b2, level="geometric")
    assert loss2.item() == pytest.approx(DUAL_CLIP) and m["loss/dual_clip_frac"].item() == 1.0
    # level="sequence" is eq. 3's product: ρ = e^{0+1} = e ≈ 2.7183 (geometric would be e^0.5), within [0.5, 4]
    loss3, _ = alp_policy_loss(b, level="sequence")
    assert loss3.item() == pytest.approx(math.e, rel=1e-5)


def test_alp_loss_needs_rollout_logp():
    b = LogProbBatch(logp=torch.zeros(1, 2), mask=torch.ones(1, 2), advantages=torch.tensor([1.0]))
    with pytest.raises(ValueError, match="rollout_logp"):
        alp_policy_loss(b)
    with pytest.raises(ValueError, match="level"):
        alp_clip_defaults("tokens")


@settings(max_examples=30, deadline=None)
@given(std=st.floats(1e-3, 10.0), n=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_property_noise_scale_and_gradient(std, n, seed):
    # Identity stack: out = Σ_l σ ε_l, so d(Σ out·ε-free)/dlogσ_l = Σ σ ε_l; empirical std of out ≈ σ√n.
    net = Stack(n)
    alp = LayerwisePerturbation(net, init_std=std, seed=seed)
    with alp.active():
        out = net(torch.zeros(4000))
    assert abs(out.std().item() / (std * math.sqrt(n)) - 1) < 0.1
    (out**2).sum().backward()
    # d/dlogσ_l Σ_i (Σ_k σ ε_k,i)² = 2 Σ_i out_i σ ε_l,i; summed over l this equals 2 Σ out² (exactly).
    torch.testing.assert_close(alp.log_sigma.grad.sum(), 2 * (out.detach() ** 2).sum(), rtol=1e-4, atol=1e-3)


def test_a_warning_when_16_bit_hidden_states_round_the_noise_away():
    # bf16 spacing near 1 is 2^-7 = 7.8e-3: σ = 1e-4 changes almost no element; σ = 0.5 changes nearly all
    h = torch.ones(1, 64, dtype=torch.bfloat16)
    net = Stack(1)
    tiny_noise = LayerwisePerturbation(net, init_std=1e-4, seed=0)
    with tiny_noise.active(), pytest.warns(UserWarning, match="rounds away"):
        net(h)
    tiny_noise.remove()
    large = LayerwisePerturbation(net, init_std=0.5, seed=0)
    with large.active(), warnings.catch_warnings():
        warnings.simplefilter("error")
        net(h)


class _Mix(nn.Module):
    """A layer with weights (so that its backward needs the saved, noisy input): h ↦ tanh(W h)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h))


class _CheckpointedMix(_Mix):
    """The same layer re-run in the backward pass (activation checkpointing, as HF's gradient checkpointing wraps a
    decoder layer's ``__call__``: its pre-hooks run inside the checkpoint)."""

    reentrant = False

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(super().__call__, h, use_reentrant=self.reentrant)


@pytest.mark.parametrize("seed", [0, None])
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_replays_the_forwards_noise(seed, reentrant):
    # The checkpointed layers re-run inside backward, after active() is left: the re-run must add the very noise the
    # forward added, so that loss and gradients (of the weights and of log σ) equal the uncheckpointed model's.
    def run(layer_cls):
        torch.manual_seed(0)
        net = nn.Module()
        net.layers = nn.ModuleList([layer_cls(4) for _ in range(3)])
        for p in net.layers.parameters():
            p.data = torch.linspace(-0.5, 0.5, p.numel()).reshape(p.shape)  # the same weights in both models
        alp = LayerwisePerturbation(net, init_std=0.3, seed=seed)
        x = torch.linspace(-1, 1, 8).reshape(2, 4).requires_grad_(reentrant)
        torch.manual_seed(1)  # the global RNG the unseeded noise draws from
        with alp.active():
            h = x
            for layer in net.layers:
                h = layer(h)
        loss = (h * torch.arange(8.0).reshape(2, 4)).sum()
        loss.backward()
        grads = [p.grad.clone() for p in net.layers.parameters()] + [alp.log_sigma.grad.clone()]
        with torch.no_grad():  # noise off again afterwards: a clean forward equals the noise-free function
            clean = x
            for layer in net.layers:
                clean = layer(clean)
        return loss.detach(), grads, clean, alp

    _CheckpointedMix.reentrant = reentrant
    loss, grads, clean, _ = run(_Mix)
    loss_ckpt, grads_ckpt, clean_ckpt, alp = run(_CheckpointedMix)
    assert float(loss_ckpt) == pytest.approx(float(loss), rel=1e-6)
    for g, g_ckpt in zip(grads, grads_ckpt):
        torch.testing.assert_close(g_ckpt, g)
    assert float(grads[-1].abs().sum()) > 0  # σ got a gradient
    torch.testing.assert_close(clean_ckpt, clean)
    assert not any(alp._drawn)  # every recorded draw was replayed once


@pytest.mark.parametrize("same_input", [False, True])
@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpointed_forward_that_drew_no_noise_stays_clean(reentrant, same_input):
    # a noisy forward that is never re-run (no backward), then a clean checkpointed forward — of another input, or of
    # the same one (its memory now belongs to the new forward: the old record is dropped): the clean forward's re-run
    # in backward adds nothing
    torch.manual_seed(0)
    _CheckpointedMix.reentrant = reentrant
    net = nn.Module()
    net.layers = nn.ModuleList([_CheckpointedMix(4)])
    alp = LayerwisePerturbation(net, init_std=0.3, seed=0)
    x = torch.ones(2, 4, requires_grad=reentrant)
    stale = x if same_input else torch.full((2, 4), 2.0)
    with alp.active(), torch.no_grad():
        net.layers[0](stale)  # a noisy forward whose backward never runs
    assert sum(map(len, alp._drawn)) == 1
    net.layers[0](x).sum().backward()  # (a reentrant checkpoint supports .backward(), not autograd.grad)
    grad = net.layers[0].lin.weight.grad
    want = torch.autograd.grad(_Mix.forward(net.layers[0], x).sum(), net.layers[0].lin.weight)[0]
    torch.testing.assert_close(grad, want)
    assert sum(map(len, alp._drawn)) == (0 if same_input else 1)
    with alp.active():  # switching the noise on drops every record
        assert not any(alp._drawn)
