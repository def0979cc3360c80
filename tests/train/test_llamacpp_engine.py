"""The reference trainer rolling out with llama.cpp's server (``rollout.engine=llamacpp``): μ comes from real
kernels, the trainer replays the reported recipe, weights are synced by GGUF export + restart every step."""

from __future__ import annotations

import math

import pytest

from offpolicy.train.config import load_config

LAB = ["model.path=lab", "task.name=pattern", "task.options={length: 8}", "task.prompts_per_step=2",
       "algorithm.group_size=2", "rollout.sampling.max_new_tokens=8", "optim.minibatches=2", "run.threads=1",
       "run.progress=false", "run.tensorboard=false", "run.checkpoint_every=0"]


def test_config_refuses_simulation_fields_on_llamacpp():
    cfg = load_config(None, ["rollout.engine=llamacpp", "rollout.llamacpp.weights=q4_0",
                             "rollout.llamacpp.kv_cache_type=q8_0"])
    assert (cfg.rollout.llamacpp.weights, cfg.rollout.llamacpp.kv_cache_type) == ("q4_0", "q8_0")
    for bad in ["rollout.weight_bits=4", "rollout.kv_cache_bits=8", "rollout.logit_noise=0.1", "rollout.sync_every=2"]:
        with pytest.raises(ValueError, match=bad.split("=")[0].replace(".", r"\.")):
            load_config(None, ["rollout.engine=llamacpp", bad])
    with pytest.raises(ValueError, match="rollout.llamacpp.weights"):
        load_config(None, ["rollout.engine=llamacpp", "rollout.llamacpp.weights=q2_k"])


def _run(tmp_path, weights, kv, preset="tis"):
    from offpolicy.train import train

    cfg = load_config(None, [*LAB, f"algorithm.preset={preset}", "run.steps=2", f"run.out_dir={tmp_path}",
                             "rollout.engine=llamacpp", f"rollout.llamacpp.weights={weights}",
                             f"rollout.llamacpp.kv_cache_type={kv}"])
    return train(cfg)


def test_trainer_steps_on_llamacpp(tmp_path):
    pytest.importorskip("xllamacpp")
    pytest.importorskip("gguf")
    from offpolicy.rollout.llamacpp import LlamaCppRolloutEngine

    exact = _run(tmp_path / "f32", "f32", "f32")
    quant = _run(tmp_path / "q4", "q4_0", "q4_0")
    for res in (exact, quant):
        assert res.steps_done == 2
        engine = res.state.engine
        assert isinstance(engine, LlamaCppRolloutEngine)
        assert len(engine.sync_log) == 2  # one export + restart per step: μ is always the current weights
        for h in res.history:  # the exact full-vocabulary KL is NaN by design: only TRM re-scores with full logits
            assert all(math.isfinite(v) for k, v in h.items() if k != "mismatch/token_kl_exact_mean"), h
        engine.close()
    k3_exact = max(h["rollout_correction/k3_kl"] for h in exact.history)
    k3_quant = min(h["rollout_correction/k3_kl"] for h in quant.history)
    # F32 GGUF + F32 KV against transformers fp32: different kernels, same numbers to ~1e-6 nats per token;
    # Q4_0 weights + q4_0 KV move μ measurably (the lab model: ~1e-3 per token)
    assert k3_exact < 1e-5
    assert k3_quant > 10 * max(k3_exact, 1e-9)
