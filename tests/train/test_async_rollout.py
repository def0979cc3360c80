"""rollout.async_mode: the queue's and the partial rollout's versions on hand-worked cases, μ from each token's own
version's weights, per-token versions reaching the loss, the staleness metrics, and short runs of both modes."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.train import steps
from offpolicy.train import update as UPDATE  # where the update's private helpers live
from offpolicy.train.async_rollout import (
    WeightHistory,
    partial_versions,
    queue_versions,
    seeded_latencies,
    segment_length,
    segment_versions,
    staleness_metrics,
)
from offpolicy.train.config import load_config
from offpolicy.train.loop import train
from offpolicy.train.scoring import score_policy

# -- the schedules, by hand ---------------------------------------------------------------------------------------------


def test_queue_keeps_groups_up_to_k_versions_old_and_drops_older_ones():
    # trainer version 6, K = 2, 4 groups: latencies 0 → v6; 3 → v3 (staleness 3 > 2: dropped); 1 → v5; 2 → v4;
    # 5 → v1 (dropped); 1 → v5. The last latency (0) is never pulled.
    assert queue_versions(6, 4, 2, [0, 3, 1, 2, 5, 1, 0]) == ([6, 5, 4, 5], 2)
    assert queue_versions(6, 2, 0, [1, 0, 2, 0]) == ([6, 6], 2)  # K = 0: only fresh groups
    # at the start of a run nothing older than version 0 exists: latency 4 at version 1 is staleness 1, kept
    assert queue_versions(1, 3, 1, [4, 0, 1]) == ([0, 1, 0], 0)
    with pytest.raises(ValueError, match="latencies ran out after 1 of 2 groups"):
        queue_versions(6, 2, 1, [0, 5])
    with pytest.raises(ValueError, match="rollout.max_staleness must be >= 0"):
        queue_versions(6, 2, -1, [0, 0])


@settings(max_examples=50, deadline=None)
@given(version=st.integers(0, 40), k=st.integers(0, 6), groups=st.integers(1, 8), seed=st.integers(0, 10**6))
def test_queue_staleness_stays_within_k_and_counts_every_drop(version, k, groups, seed):
    pulled: list[int] = []

    def recording():
        for d in seeded_latencies(seed, k):
            pulled.append(d)
            yield d

    versions, dropped = queue_versions(version, groups, k, recording())
    assert len(versions) == groups and all(0 <= version - v <= k for v in versions)
    assert dropped == sum(min(d, version) > k for d in pulled) and len(pulled) == groups + dropped


def test_seeded_latencies_cover_zero_to_k_plus_one_deterministically():
    draws = [d for d, _ in zip(seeded_latencies(3, 4), range(600))]
    assert set(draws) == {0, 1, 2, 3, 4, 5}
    assert draws[:20] == [d for d, _ in zip(seeded_latencies(3, 4), range(20))]
    assert draws[:20] != [d for d, _ in zip(seeded_latencies(4, 4), range(20))]


def test_partial_rollout_tokens_carry_their_segments_version():
    # max_new_tokens 8, K = 4 versions: S = 2; at trainer version 5 the segments are versions 2, 3, 4, 5
    v = partial_versions([8, 3, 0], 5, 4, 8)
    assert v.tolist() == [[2, 2, 3, 3, 4, 4, 5, 5], [2, 2, 3, -1, -1, -1, -1, -1], [-1] * 8]
    # 7 tokens, K = 3: S = 3, the last segment one token
    assert partial_versions([7], 9, 3, 7).tolist() == [[7, 7, 7, 8, 8, 8, 9]]
    assert segment_versions(1, 4) == [0, 0, 0, 1]  # clipped at the first version
    with pytest.raises(ValueError, match=r"rollout.max_staleness=5: a partial rollout needs 1 <= K <= "
                                         r"rollout.sampling.max_new_tokens=4"):
        segment_length(4, 5)


def test_staleness_metrics_by_hand_and_padding_never_counts():
    versions = torch.tensor([[2, 2, 3, 3], [5, -1, -1, -1]])
    m = staleness_metrics(versions, 5)  # staleness 3, 3, 2, 2, 0 → mean 2, max 3; spans 2 and 1 → 1.5
    assert float(m["staleness/mean"]) == 2.0 and float(m["staleness/max"]) == 3.0
    assert float(m["staleness/versions_per_answer"]) == 1.5
    m_padded = staleness_metrics(torch.cat([versions, torch.full((2, 3), -1)], 1), 5)
    assert all(float(m[k]) == float(m_padded[k]) for k in m)
    on_policy = staleness_metrics(torch.tensor([[4, 4, -1]]), 4)
    assert float(on_policy["staleness/mean"]) == 0.0 and float(on_policy["staleness/max"]) == 0.0


# -- the trainer --------------------------------------------------------------------------------------------------------


def _state(tmp_path, fresh, task, make_overrides, mode, k, preset="tis", **extra):
    model, tok = fresh
    ov = make_overrides(tmp_path, preset, rollout__async_mode=mode, rollout__max_staleness=k,
                        rollout__dtype="float32", task__prompts_per_step=4, **extra)
    return steps.build_state(load_config(None, ov), model=model, tokenizer=tok, task=task)


def _history_of(state, versions: int) -> list[dict[str, torch.Tensor]]:
    """Versions 0 … versions − 1 of the trainer, each the last moved by seeded noise; the state left at the last."""
    state.weight_history = WeightHistory(state.model, keep=state.cfg.rollout.max_staleness + 1)
    weights = []
    g = torch.Generator().manual_seed(0)
    for v in range(versions):
        if v:
            with torch.no_grad():
                for p in state.model.parameters():
                    p.add_(0.3 * torch.randn(p.shape, generator=g))
        state.weight_history.record(v, state.model)
        weights.append({k: t.clone() for k, t in state.model.state_dict().items()})
    state.policy_version = versions - 1
    return weights


def _score_with(state, weights, rollout):
    """The trainer's fp32 log-probs of the rollout's tokens under ``weights``."""
    model = state.weight_history.scratch
    model.load_state_dict(weights)
    logp, mask, _, _ = score_policy(model, rollout.prompt_ids, rollout.completions, state.sampling,
                                    dtype=torch.float32)
    return logp, mask


def test_a_queue_rollout_samples_each_group_with_its_versions_weights(tmp_path, fresh, varying_task, make_overrides):
    state = _state(tmp_path, fresh, varying_task(), make_overrides, "queue", 3)
    weights = _history_of(state, 6)  # versions 0 … 5, version 5 current
    seed = 11
    rollout = steps.rollout_step(state, seed)
    expected, dropped = queue_versions(5, 4, 3, seeded_latencies(seed, 3))
    assert len(set(expected)) > 1  # this seed mixes versions in one batch
    g = state.cfg.algorithm.group_size
    for row, v in enumerate(v for v in expected for _ in range(g)):
        n = len(rollout.completions[row])
        assert rollout.versions[row, :n].tolist() == [v] * n and (rollout.versions[row, n:] == -1).all()
    assert float(rollout.staleness["staleness/dropped"]) == dropped
    assert float(rollout.staleness["staleness/max"]) == max(5 - v for v in expected)
    # μ of every token is its own version's (and not the current one's, where that version is older)
    for v in sorted(set(expected)):
        logp, mask = _score_with(state, weights[v], rollout)
        rows = torch.tensor([i for i in range(len(rollout.completions)) if rollout.versions[i, 0] == v])
        torch.testing.assert_close(rollout.rollout_logp[rows][mask[rows]], logp[rows][mask[rows]], atol=1e-4, rtol=0)
        if v != 5:
            now, _ = _score_with(state, weights[5], rollout)
            assert (rollout.rollout_logp[rows][mask[rows]] - now[rows][mask[rows]]).abs().max() > 1e-2


def test_a_partial_rollout_switches_weights_mid_answer(tmp_path, fresh, varying_task, make_overrides):
    state = _state(tmp_path, fresh, varying_task(), make_overrides, "partial", 2)  # 4 new tokens: S = 2
    weights = _history_of(state, 4)  # versions 0 … 3: segments with versions 2, 3
    rollout = steps.rollout_step(state, seed=5)
    lengths = [len(c) for c in rollout.completions]
    assert max(lengths) == 4
    assert torch.equal(rollout.versions, partial_versions(lengths, 3, 2, 4))
    at2, mask = _score_with(state, weights[2], rollout)
    at3, _ = _score_with(state, weights[3], rollout)
    first, second = mask.clone(), mask.clone()
    first[:, 2:] = False
    second[:, :2] = False
    torch.testing.assert_close(rollout.rollout_logp[first], at2[first], atol=1e-4, rtol=0)
    torch.testing.assert_close(rollout.rollout_logp[second], at3[second], atol=1e-4, rtol=0)
    assert (rollout.rollout_logp[second] - at2[second]).abs().max() > 1e-2  # the switch changed μ
    assert float(rollout.staleness["staleness/versions_per_answer"]) > 1.0


def test_sequence_version_record_gives_each_answer_its_oldest_version(tmp_path, fresh, varying_task,
                                                                       make_overrides):
    """rollout.version_record=sequence: the same μ as per-token records, every token tagged with the answer's oldest
    version (verl's min_global_steps), padding still −1."""
    start = {k: t.clone() for k, t in fresh[0].state_dict().items()}
    by_token = _state(tmp_path / "t", fresh, varying_task(), make_overrides, "partial", 2)
    _history_of(by_token, 4)
    fresh[0].load_state_dict(start)  # the same four versions for the second state
    token_rollout = steps.rollout_step(by_token, seed=5)
    by_sequence = _state(tmp_path / "s", fresh, varying_task(), make_overrides, "partial", 2,
                         rollout__version_record="sequence")
    _history_of(by_sequence, 4)
    seq_rollout = steps.rollout_step(by_sequence, seed=5)
    torch.testing.assert_close(seq_rollout.rollout_logp, token_rollout.rollout_logp, rtol=0, atol=0)
    valid = token_rollout.versions >= 0
    assert torch.equal(seq_rollout.versions >= 0, valid)
    oldest = torch.where(valid, token_rollout.versions, 99).amin(dim=1)
    for row in range(len(oldest)):
        assert set(seq_rollout.versions[row][valid[row]].tolist()) <= {int(oldest[row])}
    assert (token_rollout.versions != seq_rollout.versions).any()  # some answer did span two versions
    assert float(seq_rollout.staleness["staleness/versions_per_answer"]) == 1.0


@pytest.mark.parametrize("proximal", ["recompute", "loglinear"])
def test_per_token_versions_reach_the_loss(tmp_path, fresh, varying_task, make_overrides, monkeypatch, proximal):
    state = _state(tmp_path, fresh, varying_task(), make_overrides, "partial", 2, algorithm__objective="decoupled",
                   algorithm__proximal=proximal)
    _history_of(state, 4)
    rollout = steps.rollout_step(state, seed=5)
    assert any(len(set(row[row >= 0].tolist())) > 1 for row in rollout.versions)  # versions vary within a row
    seen = []
    real = UPDATE._loss

    def capture(st_, batch):
        seen.append(batch)
        return real(st_, batch)

    monkeypatch.setattr(UPDATE, "_loss", capture)
    scored = steps.score_step(state, rollout)
    order = torch.Generator().manual_seed(7)
    perms = [torch.randperm(len(rollout.prompt_ids), generator=order) for _ in range(state.cfg.optim.epochs)]
    UPDATE.update_step(state, rollout, scored, seed=7)
    batches = iter(seen)
    for perm in perms:
        for rows in perm.tensor_split(state.cfg.optim.minibatches):
            batch = next(batches)
            assert batch.policy_version == 3
            assert torch.equal(batch.versions, rollout.versions[rows, : batch.seq_len])  # per token, not per row


def test_loglinear_alpha_differs_per_token_from_a_per_sequence_version():
    from offpolicy.objectives.proximal import loglinear_alpha

    per_token = partial_versions([4], 3, 2, 4)  # [[2, 2, 3, 3]] at v_θ = 3: α = 0 everywhere
    per_row_min = torch.full_like(per_token, 1)  # a sequence tagged with an older version: α = 1/2
    assert loglinear_alpha(per_token, 3).tolist() == [[0.0, 0.0, 0.0, 0.0]]
    assert loglinear_alpha(per_row_min, 3).tolist() == [[0.5] * 4]


@pytest.mark.parametrize("mode, k", [("queue", 2), ("partial", 2)])
def test_a_short_run_logs_per_token_staleness(tmp_path, fresh, varying_task, make_overrides, mode, k):
    model, tok = fresh
    ov = make_overrides(tmp_path, "tis", steps=3, rollout__async_mode=mode, rollout__max_staleness=k,
                        algorithm__objective="decoupled", algorithm__proximal="loglinear")
    result = train(load_config(None, ov), model=model, tokenizer=tok, task=varying_task())
    assert result.steps_done == 3
    first, *_, last = result.history
    assert first["staleness/max"] == 0.0  # version 0: nothing older exists
    assert 0.0 <= last["staleness/mean"] <= last["staleness/max"] <= k
    assert all(abs(row["loss/loss"]) < float("inf") for row in result.history)
    from offpolicy.glossary import lookup

    assert sorted(k for k in last if k.startswith("staleness/") and lookup(k) is None) == []  # each in the glossary
    for row in result.history:  # the split by staleness covers every valid token once, and only d ≤ K
        ds = sorted(int(key.split("/")[1][1:]) for key in row if key.endswith("/tokens") and key.startswith("staleness/d"))
        assert ds and max(ds) == row["staleness/max"] and max(ds) <= k
        n = row["response/length_mean"] * 2 * 2  # prompts × group size rows
        assert sum(row[f"staleness/d{d}/tokens"] for d in ds) == pytest.approx(n)


def test_the_staleness_numbers_agree_with_the_trl_integrations_split():
    from offpolicy.metrics import metrics_by_staleness as trl_split

    versions = partial_versions([6, 3, 5], 7, 3, 6)  # S = 2: versions 5, 6, 7
    stale = torch.where(versions >= 0, 7 - versions, -1)
    mask = (versions >= 0).float()
    theirs = trl_split(stale, torch.zeros(3, 6), torch.zeros(3, 6), mask)
    ours = staleness_metrics(versions, 7)
    for key in ("staleness/mean", "staleness/max"):
        assert float(ours[key]) == pytest.approx(float(theirs[key]))
    assert [float(theirs[f"staleness/d{d}/tokens"]) for d in (2, 1, 0)] == [6.0, 5.0, 3.0]


def test_a_lagging_engine_logs_its_staleness_too(tmp_path, fresh, varying_task, make_overrides):
    model, tok = fresh
    ov = make_overrides(tmp_path, "naive", steps=3, rollout__sync_every=4)
    history = train(load_config(None, ov), model=model, tokenizer=tok, task=varying_task()).history
    assert [row["staleness/max"] for row in history] == [0.0, 1.0, 2.0]  # synced at step 0 only
    assert Counter(row["staleness/versions_per_answer"] for row in history) == Counter({1.0: 3})
    assert [sorted(k for k in row if k.endswith("/tokens")) for row in history] == [
        ["staleness/d0/tokens"], ["staleness/d1/tokens"], ["staleness/d2/tokens"]]  # one staleness per lagging batch


@pytest.mark.parametrize("extra, message", [
    ({"rollout__max_staleness": 0}, r"rollout.max_staleness must be >= 1"),
    ({"rollout__max_staleness": 2, "rollout__sync_every": 2}, r"rollout.sync_every must be 1"),
    ({"rollout__max_staleness": 9}, r"1 <= K <= rollout.sampling.max_new_tokens=4"),
    ({"rollout__max_staleness": 2, "rollout__sync_check": "error"}, r"rollout.sync_check='error'"),
    ({"rollout__async_mode": "none", "rollout__version_record": "sequence"}, r"rollout.version_record=sequence"),
])
def test_async_configs_the_trainer_cannot_run_are_refused(tmp_path, fresh, varying_task, make_overrides, extra,
                                                          message):
    model, tok = fresh
    ov = make_overrides(tmp_path, "naive", **{"rollout__async_mode": "partial", **extra})
    with pytest.raises(ValueError, match=message):
        steps.build_state(load_config(None, ov), model=model, tokenizer=tok, task=varying_task())
