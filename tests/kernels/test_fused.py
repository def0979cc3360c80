"""offpolicy.kernels: values and gradients of every output against the naive full-logits computation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from offpolicy.kernels import (
    DIFF_OUTPUTS,
    chunk_rows,
    fused_logp,
    fused_token_stats,
    row_chunks,
    token_stats_from_logits,
)

ALL = ("logp", "entropy", "minp_logp", "minp_mass", "kl", "tv")


def naive_stats(z: torch.Tensor, y: torch.Tensor, *, rho=None, roll=None, tk_logp=None, tk_ids=None,
                roll_temperature=1.0) -> dict[str, torch.Tensor]:
    """Reference: everything from the full [N, V] logits with plain autograd (z already / temperature)."""
    valid = y != -100
    ys = y.clamp(min=0)[:, None]
    logp_all = torch.log_softmax(z, -1)
    p = logp_all.exp()
    out = {"logp": logp_all.gather(1, ys)[:, 0], "entropy": -(p * logp_all).sum(-1)}
    if rho is not None:
        safe = (z >= z.detach().amax(-1, keepdim=True) + math.log(rho)).detach()
        zs = torch.where(safe, z, torch.tensor(float("-inf"), dtype=z.dtype))
        out["minp_logp"] = z.gather(1, ys)[:, 0] - zs.logsumexp(-1)
        out["minp_mass"] = (p * safe).sum(-1)
        out["minp_inside"] = safe.gather(1, ys)[:, 0]
    if roll is not None:
        lq = torch.log_softmax(roll.to(z.dtype) / roll_temperature, -1)
        q = lq.exp()
        out["kl"] = torch.where(q > 0, q * (lq - logp_all), torch.zeros((), dtype=z.dtype)).sum(-1)
        out["tv"] = 0.5 * (q - p).abs().sum(-1)
    if tk_logp is not None:
        lq = tk_logp.to(z.dtype)
        q = lq.exp()
        q_rest = 1 - q.sum(-1)
        has_rest = q_rest > 4 * tk_logp.shape[-1] * torch.finfo(z.dtype).eps  # below: rounding noise, no bucket
        q_rest = torch.where(has_rest, q_rest, torch.zeros((), dtype=z.dtype))
        p_ids = p.gather(1, tk_ids)
        in_ids = torch.zeros_like(z, dtype=torch.bool).scatter(1, tk_ids, True)
        p_rest = torch.where(in_ids, torch.tensor(float("-inf"), dtype=z.dtype), logp_all).logsumexp(-1).exp()
        head = torch.where(q > 0, q * (lq - logp_all.gather(1, tk_ids)), torch.zeros((), dtype=z.dtype)).sum(-1)
        safe_q = torch.where(has_rest, q_rest, torch.ones((), dtype=z.dtype))  # keeps log() out of where's grad
        safe_p = torch.where(has_rest, p_rest, torch.ones((), dtype=z.dtype))
        tail = torch.where(has_rest, q_rest * (safe_q.log() - safe_p.log()), torch.zeros((), dtype=z.dtype))
        out["kl"] = head + tail
        out["tv"] = 0.5 * ((q - p_ids).abs().sum(-1) + (q_rest - p_rest).abs())
    return {k: torch.where(valid, v, torch.zeros((), dtype=v.dtype)) for k, v in out.items()}


def make(n=7, h=5, v=13, k=4, dtype=torch.float64, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    hid = (torch.randn(n, h, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_()
    w = (torch.randn(v, h, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_()
    b = torch.randn(v, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g)
    y[n // 2] = -100
    roll = torch.randn(n, v, generator=g, dtype=torch.float64) * 2
    tk = torch.log_softmax(roll, -1).topk(min(k, v), -1)
    return hid, w, b, y, roll, tk.values, tk.indices


@pytest.mark.parametrize("source", ["logits", "topk"])
def test_gradcheck_float64_all_outputs(source):
    hid, w, b, y, roll, tkl, tki = make()
    kw = {"rollout_logits": roll} if source == "logits" else {"rollout_topk_logp": tkl, "rollout_topk_ids": tki}
    # 3 · 13 · 8 bytes: about one row per forward chunk and 1-3 columns per backward tile -> many chunks and tiles.
    budget = 3 * 13 * 8 * 9

    def f(hid, w, b):
        s = fused_token_stats(hid, w, y, bias=b, temperature=0.7, want=ALL, min_p_rho=0.05,
                              memory_budget_bytes=budget, **kw)
        return tuple(getattr(s, k) for k in ALL)

    assert torch.autograd.gradcheck(f, (hid, w, b))


def test_gradcheck_logits_path():
    _, _, _, y, roll, tkl, tki = make()
    z = torch.randn(7, 13, dtype=torch.float64, requires_grad=True)
    for kw in ({"rollout_logits": roll}, {"rollout_topk_logp": tkl, "rollout_topk_ids": tki}):
        def f(z, kw=kw):
            s = token_stats_from_logits(z, y, temperature=1.3, want=ALL, min_p_rho=0.1, memory_budget_bytes=500, **kw)
            return tuple(getattr(s, k) for k in ALL)
        assert torch.autograd.gradcheck(f, (z,))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 19), v=st.integers(2, 41), h=st.integers(1, 9), k=st.integers(1, 8),
       budget_rows=st.integers(1, 6), temperature=st.sampled_from([1.0, 0.6, 1.7]), use_bias=st.booleans(),
       source=st.sampled_from(["logits", "topk"]), seed=st.integers(0, 10_000))
def test_float32_matches_naive_values_and_grads(n, v, h, k, budget_rows, temperature, use_bias, source, seed):
    hid, w, b, y, roll, tkl, tki = make(n, h, v, k, dtype=torch.float32, seed=seed, scale=1.5)
    b = b if use_bias else None
    kw = {"rollout_logits": roll.float()} if source == "logits" else {"rollout_topk_logp": tkl.float(),
                                                                       "rollout_topk_ids": tki}
    # budget for `budget_rows` rows of [V] fp32 × the kernel's buffers: V is rarely a multiple of the tile width.
    s = fused_token_stats(hid, w, y, bias=b, temperature=temperature, want=ALL, min_p_rho=0.02,
                          memory_budget_bytes=budget_rows * v * 4 * 9, **kw)
    z = hid @ w.T + (b if b is not None else 0)
    ref = naive_stats(z / temperature, y, rho=0.02, roll=kw.get("rollout_logits"), tk_logp=kw.get("rollout_topk_logp"),
                      tk_ids=kw.get("rollout_topk_ids"))
    for name in ALL:
        torch.testing.assert_close(getattr(s, name), ref[name], atol=2e-5, rtol=2e-5)
    assert torch.equal(s.minp_inside, ref["minp_inside"])
    coefs = torch.randn(len(ALL), n, generator=torch.Generator().manual_seed(seed))
    params = [hid, w] + ([b] if b is not None else [])
    got = torch.autograd.grad(sum((c * getattr(s, k)).sum() for c, k in zip(coefs, ALL)), params)
    want = torch.autograd.grad(sum((c * ref[k]).sum() for c, k in zip(coefs, ALL)), params)
    for g1, g2 in zip(got, want):
        torch.testing.assert_close(g1, g2, atol=1e-4, rtol=1e-4)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 17), v=st.integers(2, 37), budget_elems=st.integers(1, 200),
       source=st.sampled_from([None, "logits", "topk"]), seed=st.integers(0, 10_000))
def test_online_tiled_forward_matches_naive(n, v, budget_elems, source, seed):
    # Without min-p and TV the forward streams over vocabulary slices with running max / rescaled sums.
    hid, w, b, y, roll, tkl, tki = make(n, 3, v, 3, dtype=torch.float64, seed=seed, scale=2.0)
    roll[:, 0] = float("-inf")  # a rollout that never samples token 0: 0 · log 0 must count as 0
    kw = {} if source is None else ({"rollout_logits": roll} if source == "logits" else
                                    {"rollout_topk_logp": tkl, "rollout_topk_ids": tki})
    want = ("logp", "entropy") + (("kl",) if source else ())
    s = fused_token_stats(hid, w, y, bias=b, want=want, memory_budget_bytes=budget_elems * 8 * 4, **kw)
    ref = naive_stats(hid @ w.T + b, y, roll=kw.get("rollout_logits"), tk_logp=kw.get("rollout_topk_logp"),
                      tk_ids=kw.get("rollout_topk_ids"))
    for name in want:
        torch.testing.assert_close(getattr(s, name), ref[name])
    params = (hid, w, b)
    got = torch.autograd.grad(sum(getattr(s, k).sum() for k in want), params)
    exp = torch.autograd.grad(sum(ref[k].sum() for k in want), params)
    for g1, g2 in zip(got, exp):
        torch.testing.assert_close(g1, g2)


def test_bf16_inputs_accumulate_in_fp32():
    hid, w, b, y, roll, _, _ = make(9, 16, 50, dtype=torch.bfloat16, seed=3)
    s = fused_token_stats(hid, w, y, bias=b, want=ALL, min_p_rho=1e-3, rollout_logits=roll.bfloat16(),
                          memory_budget_bytes=4096)
    assert all(getattr(s, k).dtype == torch.float32 for k in ALL)
    # Reference: the same bf16 values up-cast, all in float32.
    h32, w32, b32 = (t.detach().float().requires_grad_() for t in (hid, w, b))
    ref = naive_stats(h32 @ w32.T + b32, y, rho=1e-3, roll=roll.bfloat16().float())
    for name in ALL:
        torch.testing.assert_close(getattr(s, name), ref[name], atol=1e-4, rtol=1e-4)
    loss = sum(getattr(s, k).sum() for k in ALL)
    grads = torch.autograd.grad(loss, (hid, w, b))
    ref_grads = torch.autograd.grad(sum(ref[k].sum() for k in ALL), (h32, w32, b32))
    for g, r in zip(grads, ref_grads):
        assert g.dtype == torch.bfloat16 and torch.isfinite(g.float()).all()
        torch.testing.assert_close(g.float(), r, atol=3e-2, rtol=3e-2)  # bf16 output rounding only


def test_ignore_index_rows_are_zero_and_get_no_gradient():
    hid, w, _, y, roll, _, _ = make(6, 4, 10, dtype=torch.float32)
    y = torch.tensor([1, -100, 2, -100, 3, 4])
    s = fused_token_stats(hid, w, y, want=ALL, min_p_rho=0.1, rollout_logits=roll.float())
    for name in ALL:
        assert torch.all(getattr(s, name)[[1, 3]] == 0)
    (gh,) = torch.autograd.grad(sum(getattr(s, k).sum() for k in ALL), (hid,))
    assert torch.all(gh[[1, 3]] == 0) and torch.all(gh[[0, 2]] != 0)


def test_uniform_policy_hand_values():
    # Zero weights: π uniform over V = 8. logp = −log 8 = −2.0794, entropy = log 8 = 2.0794, every token is in the
    # min-p safe set (all logits equal the max), so Z = 1 and log π^mp = log π.
    s = fused_token_stats(torch.zeros(3, 2), torch.zeros(8, 2), torch.tensor([0, 5, 7]), want=("logp", "entropy", "minp"),
                          min_p_rho=0.5)
    torch.testing.assert_close(s.logp, torch.full((3,), -math.log(8)))
    torch.testing.assert_close(s.entropy, torch.full((3,), math.log(8)))
    torch.testing.assert_close(s.minp_mass, torch.ones(3))
    torch.testing.assert_close(s.minp_logp, s.logp)


def test_two_token_kl_hand_value():
    # π = softmax(0, log 3) = (1/4, 3/4) from z = W h with h = 1, W = (0, log 3); μ = (1/2, 1/2):
    # KL(μ‖π) = ½ log(½ / ¼) + ½ log(½ / ¾) = ½ (0.6931 − 0.4055) = 0.1438; TV = ½ (¼ + ¼) = 0.25.
    s = fused_token_stats(torch.ones(1, 1), torch.tensor([[0.0], [math.log(3)]]), torch.tensor([0]), want=("kl", "tv"),
                          rollout_logits=torch.zeros(1, 2))
    assert s.kl_kind == "exact"
    assert s.kl.item() == pytest.approx(0.1438, abs=1e-4)
    assert s.tv.item() == pytest.approx(0.25, abs=1e-6)


def test_fused_logp_matches_log_softmax():
    hid, w, b, y, *_ = make(11, 6, 29, dtype=torch.float32, seed=5)
    y = y.clamp(min=0)
    got = fused_logp(hid, w, y, bias=b, temperature=0.8, memory_budget_bytes=1000)
    ref = torch.log_softmax((hid @ w.T + b) / 0.8, -1).gather(1, y[:, None])[:, 0]
    torch.testing.assert_close(got, ref)


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_n_by_v_tensor_is_ever_created():
    n, h, v = 96, 4, 700
    hid, w, b, y, roll, tkl, tki = make(n, h, v, 5, dtype=torch.float32)
    budget = 40_000  # bytes: 10k fp32 elements of scratch
    with _LargestTensor() as mode:
        s = fused_token_stats(hid, w, y, bias=b, want=("logp", "entropy", "minp", "kl", "tv"), min_p_rho=0.01,
                              rollout_topk_logp=tkl.float(), rollout_topk_ids=tki, memory_budget_bytes=budget)
        sum(getattr(s, k).sum() for k in ALL).backward()
    # Largest tensor: a chunk/tile (≤ budget / 4 elements) or ∂W [V, H] = 2800 — never N · V = 67200.
    assert mode.largest <= max(budget // 4, v * h)
    assert mode.largest < n * v // 4


def test_chunk_rows_arithmetic():
    # 256 MiB / (151936 · 4 B · 4 buffers) = 268435456 / 2430976 = 110.4 -> 110 rows
    assert chunk_rows(2048, 151936, buffers=4) == 110
    assert chunk_rows(2048, 151936, buffers=4, memory_budget_bytes=1) == 1  # one row always fits
    assert chunk_rows(3, 10, buffers=1) == 3
    assert row_chunks(7, 3) == [(0, 3), (3, 6), (6, 7)]


def test_outputs_not_requested_are_none_and_validation_names_arguments():
    hid, w, _, y, roll, tkl, tki = make(4, 3, 6, dtype=torch.float32)
    s = fused_token_stats(hid, w, y)
    assert s.entropy is None and s.kl is None and s.minp_logp is None and s.logp is not None
    with pytest.raises(ValueError, match="min_p_rho"):
        fused_token_stats(hid, w, y, want=("minp",))
    with pytest.raises(ValueError, match="rollout"):
        fused_token_stats(hid, w, y, want=("kl",))
    with pytest.raises(ValueError, match="rollout_logits"):
        fused_token_stats(hid, w, y, rollout_logits=roll[:, :3])
    with pytest.raises(ValueError, match="weight"):
        fused_token_stats(hid, w[:, :2], y)
    with pytest.raises(ValueError, match="targets"):
        fused_token_stats(hid, w, y.float())
    with pytest.raises(ValueError, match="temperature"):
        fused_token_stats(hid, w, y, temperature=0.0)
    with pytest.raises(ValueError, match="want"):
        fused_token_stats(hid, w, y, want=("perplexity",))
    assert set(DIFF_OUTPUTS) == set(ALL)


def test_logits_path_with_minus_inf_logits_matches_the_pruned_vocabulary():
    # A masked vocabulary (−inf logits) behaves like the vocabulary without those tokens: finite entropy and grads.
    g = torch.Generator().manual_seed(2)
    z = torch.randn(4, 6, generator=g, dtype=torch.float64)
    roll = torch.randn(4, 6, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 0])
    zi = torch.cat([z, torch.full((4, 2), float("-inf"), dtype=torch.float64)], -1).requires_grad_()
    ri = torch.cat([roll, torch.full((4, 2), float("-inf"), dtype=torch.float64)], -1)
    z = z.requires_grad_()
    want = ("logp", "entropy", "minp_logp", "kl", "tv")
    s = token_stats_from_logits(zi, y, want=want, min_p_rho=0.01, rollout_logits=ri)
    r = token_stats_from_logits(z, y, want=want, min_p_rho=0.01, rollout_logits=roll)
    for name in want:
        torch.testing.assert_close(getattr(s, name), getattr(r, name))
    (gi,) = torch.autograd.grad(sum(getattr(s, k).sum() for k in want), zi)
    (gr,) = torch.autograd.grad(sum(getattr(r, k).sum() for k in want), z)
    assert torch.isfinite(gi).all()
    torch.testing.assert_close(gi[:, :6], gr)
    assert torch.all(gi[:, 6:] == 0)
