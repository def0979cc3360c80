"""Score centering (arXiv 2609.20807) in verl's own worker path: the plug-in's engine centres the score of the update
forward on the rollout's top-K (``OFFPOLICY_VERL: {topk_logprobs: K, score_centering: true}``).

verl 0.9.1's ``TrainingWorker`` + FSDP2 on CPU, with the harness of ``test_verl_actor.py`` (offpolicy_testkit/verl_cpu.py) (tiny random Qwen2, fp32,
two micro-batches per mini-batch). The batch carries stub top-K fields laid out as the agent loop writes them. Checked:

* the loss value is verl's vanilla one (centring keeps log p(y)'s value);
* the gradient is that of a reference built outside verl on the same model: −A·centered_logp(log p, c) with
  c = ``score_center_topk`` on the same logits, token-mean over the mini-batch (PPO at ratio 1: π_old = π_θ);
* on-policy (the head is the trainer's own full distribution, K = V) the gradient is vanilla's: E_q[∇log p] = 0.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl")

from offpolicy_testkit.verl_cpu import ActorBatch, make_worker, process_group, setup_cpu_verl, tiny_qwen2

from offpolicy import centered_logp, score_center_topk, topk_drift_tv  # noqa: E402
from offpolicy.integrations.verl import parse_settings  # noqa: E402

K = 4
T = 0.7


SHAPE = ActorBatch()  # the verl tests' batch (offpolicy_testkit/verl_cpu.py)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    setup_cpu_verl()
    with process_group():
        yield tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2_sc"))


@pytest.fixture(scope="module")
def workers(model_path):
    """(plain, centring) plug-in engines on the same weights (lr 0: every call sees the same model)."""
    return (make_worker(model_path, {"topk_logprobs": K}),
            make_worker(model_path, {"topk_logprobs": K, "score_centering": True}))


def _with_head(data, lp: torch.Tensor, ids: torch.Tensor):
    """The batch with the agent loop's top-K fields (``sequence_topk`` per sample) for the response head [B, R, k]."""
    from offpolicy.integrations.verl.topk import TOPK_IDS_FIELD, TOPK_LOGP_FIELD, sequence_topk

    attention_mask = SHAPE.inputs()[1]
    per_sample = [sequence_topk(int(attention_mask[i, :SHAPE.p].sum()), ids[i, :n].tolist(), lp[i, :n].tolist(),
                                ids.shape[-1]) for i, n in enumerate(SHAPE.lengths.tolist())]
    data[TOPK_LOGP_FIELD] = torch.nested.as_nested_tensor([s[0] for s in per_sample], layout=torch.jagged)
    data[TOPK_IDS_FIELD] = torch.nested.as_nested_tensor([s[1] for s in per_sample], layout=torch.jagged)
    return data


def _train(worker, lp, ids, old):
    tensors = {"old_log_probs": old, "advantages": SHAPE.advantages[:, None].expand(SHAPE.b, SHAPE.r).contiguous()}
    return SHAPE.train(worker, "vanilla", "token-mean", tensors, meta={"temperature": T},
                    prepare=lambda d: _with_head(d, lp, ids))


def _reference_grad(model_path, lp, ids, centre: bool) -> torch.Tensor:
    """∇ of Σ_t −A·ℓ_t / N over the response tokens (verl's token-mean over the whole mini-batch, PPO at ratio 1),
    ℓ = log p(y) or centered_logp(log p(y), score_center_topk(z, ids, lp, T)); a fresh copy of the same weights."""
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32, attn_implementation="eager")
    input_ids, attention_mask = SHAPE.inputs()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    z = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    z = z[:, SHAPE.p - 1:SHAPE.p + SHAPE.r - 1].float()  # [B, R, V], the logits that predict each response token
    logp = (z / T).log_softmax(-1).gather(-1, input_ids[:, SHAPE.p:, None]).squeeze(-1)
    if centre:
        logp = centered_logp(logp, score_center_topk(z, ids, lp, temperature=T))
    mask = attention_mask[:, SHAPE.p:].float()
    loss = -(SHAPE.advantages[:, None] * logp * mask).sum() / mask.sum()
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_settings_refuse_what_is_not_built():
    assert parse_settings({"topk_logprobs": 4, "score_centering": True}).score_centering
    with pytest.raises(ValueError, match="score_centering needs the engine's top-K: set topk_logprobs"):
        parse_settings({"score_centering": True})
    with pytest.raises(ValueError, match="score_centering cannot be combined with sampling"):
        parse_settings({"topk_logprobs": 4, "score_centering": True, "sampling": {"min_p": 0.1}})
    # ALP composes: the centre is taken from the same noisy update forward as π_{θ,σ}
    both = parse_settings({"topk_logprobs": 4, "score_centering": True, "alp": {}})
    assert both.score_centering and both.alp is not None
    with pytest.raises(ValueError, match="score_centering must be true or false"):
        parse_settings({"topk_logprobs": 4, "score_centering": "yes"})


def test_centring_keeps_the_loss_and_gives_the_reference_gradient(model_path, workers):
    plain, centring = workers
    z = SHAPE.reference_logits(plain)  # [B, R, V] from the engine's module
    noise = 0.5 * torch.randn(z.shape, generator=torch.Generator().manual_seed(5))
    lp, ids = ((z + noise) / T).log_softmax(-1).topk(K, dim=-1)  # μ ≠ π: the drift term is not zero
    old = SHAPE.infer_logp(plain, {"temperature": T})  # π_old = π_θ: PPO's ratio is 1, its gradient −A·∇ℓ / N

    plain_metrics, plain_grad = _train(plain, lp, ids, old)
    ours_metrics, ours_grad = _train(centring, lp, ids, old)
    # (a) the value: centring adds c − sg(c) = 0 to every log-prob
    assert ours_metrics["actor/pg_loss"] == pytest.approx(plain_metrics["actor/pg_loss"], rel=1e-6)
    # the reference reproduces verl's vanilla gradient (its loss and scale are verl's) ...
    torch.testing.assert_close(plain_grad, _reference_grad(model_path, lp, ids, centre=False), rtol=1e-4, atol=1e-6)
    # (b) ... and the centred one: the engine centres on the same logits and top-K
    expected = _reference_grad(model_path, lp, ids, centre=True)
    torch.testing.assert_close(ours_grad, expected, rtol=1e-4, atol=1e-6)
    assert (ours_grad - plain_grad).norm() > 0.05 * plain_grad.norm()  # the centring changed the update
    # (d) the drift and head mass under the trainer's and TRL's names (verl's trainer prefixes actor/): per
    # micro-batch (rows 0–3, 4–7) the mean over its response tokens, as verl lists a metric per micro-batch
    mask = SHAPE.inputs()[1][:, SHAPE.p:].bool()
    per_token = {"drift_tv": topk_drift_tv(z, ids, lp, temperature=T), "head_mass_q": lp.exp().sum(-1)}
    for name, values in per_token.items():
        want = [values[rows][mask[rows]].mean().item() for rows in (slice(0, 4), slice(4, 8))]
        assert ours_metrics[f"score_centering/{name}"] == pytest.approx(want, rel=1e-5), name
        assert f"score_centering/{name}" not in plain_metrics

    # (c) on-policy: the head is π_θ itself over the whole vocabulary (K = V): q̂ = p, E_q[∇log p] = 0
    full_lp, full_ids = (z / T).log_softmax(-1).topk(z.shape[-1], dim=-1)
    _, on_policy_grad = _train(centring, full_lp, full_ids, old)
    torch.testing.assert_close(on_policy_grad, plain_grad, rtol=1e-4, atol=1e-6)


def test_centring_without_the_top_k_in_the_batch_is_refused(workers):
    _, centring = workers
    old = SHAPE.infer_logp(centring, {"temperature": T})
    tensors = {"old_log_probs": old, "advantages": SHAPE.advantages[:, None].expand(SHAPE.b, SHAPE.r).contiguous()}
    with pytest.raises(ValueError, match="score_centering: the update batch has no offpolicy_topk_ids"):
        SHAPE.train(centring, "vanilla", "token-mean", tensors, meta={"temperature": T})


def test_centring_on_the_packed_path(model_path, workers):
    """``use_remove_padding=True``: the packed rows get their own top-K (prompt rows a point mass); same gradient."""
    plain, _ = workers
    packed = make_worker(model_path, {"topk_logprobs": K, "score_centering": True}, remove_padding=True)
    z = SHAPE.reference_logits(plain)
    noise = 0.5 * torch.randn(z.shape, generator=torch.Generator().manual_seed(6))
    lp, ids = ((z + noise) / T).log_softmax(-1).topk(K, dim=-1)
    old = SHAPE.infer_logp(plain, {"temperature": T})
    metrics, grad = _train(packed, lp, ids, old)
    torch.testing.assert_close(grad, _reference_grad(model_path, lp, ids, centre=True), rtol=1e-4, atol=1e-6)
    mask = SHAPE.inputs()[1][:, SHAPE.p:].bool()  # the packed rows' drift, back in the response layout
    drift = topk_drift_tv(z, ids, lp, temperature=T)
    want = [drift[rows][mask[rows]].mean().item() for rows in (slice(0, 4), slice(4, 8))]
    assert metrics["score_centering/drift_tv"] == pytest.approx(want, rel=1e-5)
