"""The off-policy update envelope experiment (ALP paper Fig. 2) on a tiny random model."""

import math

import torch

from offpolicy.lab.mechanisms import BIN_EDGES, QUANTILES, binned_quantiles, plot_envelopes, update_envelopes

TINY = "{num_hidden_layers: 2, hidden_size: 32, intermediate_size: 64, num_attention_heads: 2, num_key_value_heads: 1}"


def test_binned_quantiles_by_hand():
    # bin [0.1, 1]: log-ratios 0, 1, 2 → quantiles at positions (0.1, 0.5, 1, 1.5, 1.9) → 0.1, 0.5, 1, 1.5, 1.9
    lr = torch.tensor([[0.0, 1.0, 2.0, -3.0, 9.0]])
    p = torch.tensor([[0.5, 0.2, 0.9, 1e-7, 0.5]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])  # the 9.0 is padding: never counted
    out = binned_quantiles(lr, p, mask)
    assert out["count"] == [1, 0, 0, 0, 0, 0, 3]
    assert out["quantiles"][-1] == [0.1, 0.5, 1.0, 1.5, 1.9]
    assert out["quantiles"][0] == [-3.0] * len(QUANTILES) and out["quantiles"][1] is None
    assert len(out["count"]) == len(BIN_EDGES) - 1


def test_update_envelopes_share_one_batch_and_spread_with_updates(tmp_path, varying_task):
    ov = ["model.path=tiny-random", f"model.tiny_config={TINY}", "task.prompts_per_step=2", "algorithm.group_size=4",
          "rollout.sampling.max_new_tokens=6", "run.progress=false", "run.tensorboard=false", "optim.lr=3e-2"]
    res = update_envelopes(ov, ["naive", "mis"], updates=3, out_dir=tmp_path, task=varying_task())
    naive, mis = res["presets"]["naive"], res["presets"]["mis"]
    # the same rollout batch and the same weights before the first update: identical envelopes
    assert naive["envelopes"][0] == mis["envelopes"][0]
    # bf16 engine vs fp32 trainer: a small spread before any update, a much larger one after three at lr 3e-2
    spreads = [x for x in naive["tail_spread"] if x is not None] or [x for x in naive["head_spread"] if x is not None]
    assert len(spreads) == 4 and spreads[-1] > 10 * spreads[0] and all(math.isfinite(x) for x in spreads)
    png = plot_envelopes(res, tmp_path / "envelopes.png")
    assert png.stat().st_size > 5000
