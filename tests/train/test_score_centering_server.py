"""score_centering_topk on an engine without full logits: q's head is the rollout's own top-20 (a server's
``logprobs=K``), the drift is the proportional-tail estimate; on the transformers engine (head vs re-score) and on
llama.cpp's server (real kernels, a quantised export)."""

from __future__ import annotations

import math

import pytest
import torch

from offpolicy.objectives.score_centering import sampler_topk, score_center_topk, topk_drift_tv
from offpolicy.rollout.hf import HFRolloutEngine
from offpolicy.rollout.sampling import SamplingConfig
from offpolicy.train.build import sampling_config
from offpolicy.train.config import load_config
from offpolicy.train.loop import train
from offpolicy.train.presets import SCORE_CENTERING_TOPK

PROMPTS = [[1, 5, 9], [2, 7], [3, 4, 8, 6]]


class NoScore:
    """A rollout engine that only samples (as a server does): no ``score(..., return_logits=True)``."""

    def __init__(self, engine):
        self.engine = engine
        self.model = engine.model  # its weights (a lagging engine's are checkpointed)

    def sync_weights(self, model):
        self.engine.sync_weights(model)

    def generate(self, *args, **kwargs):
        return self.engine.generate(*args, **kwargs)


def test_the_preset_asks_the_engine_for_its_top20(tmp_path, make_overrides):
    cfg = load_config(None, make_overrides(tmp_path, "score_centering_topk"))
    assert sampling_config(cfg).logprobs_topk == SCORE_CENTERING_TOPK == 20
    assert sampling_config(load_config(None, make_overrides(tmp_path, "score_centering"))).logprobs_topk == 0


def test_reported_head_equals_the_rescored_head(tiny_pair):
    model, _ = tiny_pair
    engine = HFRolloutEngine(model, dtype="float32", kv_cache=False)
    t = 0.7
    plain = engine.generate(PROMPTS, SamplingConfig(max_new_tokens=6, temperature=t), seed=3)
    out = engine.generate(PROMPTS, SamplingConfig(max_new_tokens=6, temperature=t, logprobs_topk=20), seed=3)
    # reporting the top-k reads the log-probs the engine samples from; it does not touch the sampling
    assert out.completion_ids == plain.completion_ids and torch.equal(out.logp, plain.logp)
    assert out.topk_ids is not None and out.topk_logp is not None and out.topk_ids.shape[-1] == 20
    # the re-score path's head: the engine's raw logits, tempered by sampler_topk
    raw = engine.score(PROMPTS, out.completion_ids, SamplingConfig(temperature=t), return_logits=True)[2]
    ids, logq = sampler_topk(raw, 20, temperature=t)
    m = out.mask
    assert torch.equal(out.topk_ids[m], ids[m])
    torch.testing.assert_close(out.topk_logp[m], logq[m], atol=1e-5, rtol=0)
    # so the centre and the drift estimate are the same numbers, at T ≠ 1 (the reported log-probs are tempered)
    z = torch.randn(raw.shape, generator=torch.Generator().manual_seed(0))
    a = score_center_topk(z, out.topk_ids, out.topk_logp, temperature=t)[m]
    b = score_center_topk(z, ids, logq, temperature=t)[m]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    da = topk_drift_tv(z, out.topk_ids, out.topk_logp, temperature=t)[m]
    torch.testing.assert_close(da, topk_drift_tv(z, ids, logq, temperature=t)[m], atol=1e-5, rtol=0)
    assert float(da.min()) > 0  # random trainer logits: far from q


def test_trainer_on_the_rollout_head_matches_the_rescore(tmp_path, tiny_pair, make_overrides, varying_task):
    import copy

    model, tok = tiny_pair
    runs = {}
    for name, wrap in (("rescore", False), ("head", True)):
        m = copy.deepcopy(model)
        ov = make_overrides(tmp_path / name, "score_centering_topk", steps=2, rollout__sync_every=2,
                            rollout__dtype="float32", rollout__kv_cache="false",
                            rollout__sampling__temperature=0.7)
        engine = HFRolloutEngine(m, dtype="float32", kv_cache=False, tokenizer=tok)
        runs[name] = train(load_config(None, ov), model=m, tokenizer=tok, task=varying_task(),
                           engine=NoScore(engine) if wrap else engine)
    rescore, head = runs["rescore"].history, runs["head"].history
    for r, h in zip(rescore, head):
        # same rollouts, same head (the engine's top-20 = the re-score's top-20): the same loss
        assert h["loss/loss"] == pytest.approx(r["loss/loss"], abs=1e-5)
        assert "score_centering/topk_gap_tv" in r and "score_centering/topk_gap_tv" not in h  # unknown: not faked
        # the estimate ½‖q̂ − p‖₁ ≤ the exact ½‖q − p‖₁, short of it by at most the top-20 gap ½‖q − q̂‖₁
        exact, est, gap = r["score_centering/drift_tv"], h["score_centering/drift_tv"], r["score_centering/topk_gap_tv"]
        assert exact - gap - 1e-5 <= est <= exact + 1e-5
    assert head[1]["score_centering/drift_tv"] > 0  # step 2 samples with step 1's weights


def test_exact_centering_without_full_logits_refuses(tmp_path, fresh, make_overrides, varying_task):
    model, tok = fresh
    ov = make_overrides(tmp_path, "score_centering", steps=1, rollout__dtype="float32")
    with pytest.raises(ValueError, match="needs the sampler's logits"):
        train(load_config(None, ov), model=model, tokenizer=tok, task=varying_task(),
              engine=NoScore(HFRolloutEngine(model, dtype="float32", tokenizer=tok)))


def test_stale_table_without_the_gap():
    from offpolicy.lab.staleness import group_numbers

    rows = [{"step": i + 1, "reward/mean": 0.5, "loss/grad_norm": 1.0, "score_centering/drift_tv": 0.2 + 0.1 * i} for i in range(4)]
    numbers = group_numbers([rows, rows])
    assert numbers["drift_tv"]["median"] == pytest.approx(0.35)  # mean of 0.2, 0.3, 0.4, 0.5
    assert numbers["topk_gap_tv"]["n"] == 0  # not measured: no number, not a 0


LAB = ["model.path=lab", "task.name=pattern", "task.options={length: 8}", "task.prompts_per_step=2",
       "algorithm.group_size=2", "rollout.sampling.max_new_tokens=8", "optim.minibatches=2", "run.threads=1",
       "run.progress=false", "run.tensorboard=false", "run.checkpoint_every=0"]


def _llamacpp_run(tmp_path, weights, kv):
    return train(load_config(None, [
        *LAB, "algorithm.preset=score_centering_topk", "run.steps=2", f"run.out_dir={tmp_path}", "optim.minibatches=1",
        "rollout.engine=llamacpp", f"rollout.llamacpp.weights={weights}", f"rollout.llamacpp.kv_cache_type={kv}",
        "rollout.sampling.temperature=0.7"]))


def test_two_steps_on_llamacpp_q4_0(tmp_path):
    pytest.importorskip("xllamacpp")
    pytest.importorskip("gguf")
    from offpolicy.rollout.llamacpp import LlamaCppRolloutEngine

    drift = {}
    for weights in ("f32", "q4_0"):
        res = _llamacpp_run(tmp_path / weights, weights, weights)
        engine = res.state.engine
        try:
            # llama.cpp cannot score given tokens: q's head must be the sampling decode's own top-K
            assert isinstance(engine, LlamaCppRolloutEngine) and not engine.scores_tokens and not engine.full_logits
            rollout = res.state.last_rollout
            assert rollout is not None and rollout.topk_ids is not None and rollout.topk_logp is not None
            assert rollout.topk_ids.shape[-1] == 20  # the server's own top-20 (n_probs), post-sampling at T = 0.7
            # the head and the sampled token's log-prob are numbers of the same answer
            for i, completion in enumerate(rollout.completions):
                for j, tok in enumerate(completion):
                    hit = (rollout.topk_ids[i, j] == tok).nonzero()
                    if len(hit):
                        assert float(rollout.topk_logp[i, j, hit[0, 0]]) == pytest.approx(
                            float(rollout.rollout_logp[i, j]), abs=1e-5)
            for h in res.history:
                assert math.isfinite(h["loss/loss"]) and "score_centering/topk_gap_tv" not in h
            drift[weights] = res.history[0]["score_centering/drift_tv"]
        finally:
            engine.close()
    # one minibatch: step 1's π_θ is the engine's own weights. F32 GGUF + F32 KV: only the kernels differ, the
    # tempered head matches the trainer's p at T = 0.7 (measured ≈ 8e-7: the server's log-probs are tempered and
    # passed as they are); Q4_0 weights + q4_0 KV move q (measured ≈ 1e-2)
    assert drift["f32"] < 1e-5
    assert drift["q4_0"] > 1e-3 and drift["q4_0"] > 100 * drift["f32"]
