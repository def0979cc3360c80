"""The verl plug-in's driver and rollout parts, run through verl 0.9.1's own code.

* Driver: the plug-in's trainer (verl's ``sync`` v1 trainer with one method extended) runs verl's real
  ``_compute_advantage`` — KL-free GRPO advantages from the stored rewards — on a stand-in TransferQueue (a dict of
  nested tensors; ``transfer_queue`` itself is not installed here), then the correction; what it writes back must be
  :func:`rollout_correction` of the same tensors with verl's advantages (OPSM reads them).
* Rollout: the plug-in's agent loop (verl's single-turn loop) against a stub server that records the requests and
  answers like verl's vLLM server (``TokenOutput``; ``prompt_logprobs`` rows as its ``extract_prompt_logprobs``
  writes them): the recipe reaches ``sampling_params``, and the top-K of the response positions lands in
  ``extra_fields``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import sys
import types

import pytest
import torch

verl = pytest.importorskip("verl")
pytest.importorskip("hydra")  # verl's agent loop and v1 trainer import it (the verl-ci extra installs it)

from offpolicy_testkit.verl_stub import PROMPT, RESPONSE, K, StubServer, _agent_loop, prompt_logprobs_rows

from offpolicy.integrations.verl import (
    apply_driver_correction,
    parse_settings,
    rollout_correction,
)
from offpolicy.integrations.verl.settings import settings_from_text

B, R = 6, 5
LENGTHS = [5, 3, 4, 5, 2, 4]
UIDS = ["p0", "p0", "p0", "p1", "p1", "p1"]  # two GRPO groups of three
SCORES = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
CORRECTION = [{"name": "icepop"}, {"name": "opsm", "delta": 0.05}]


class StandInQueue:
    """The two TransferQueue calls verl's ``_compute_advantage`` makes, over a dict ``{key: {field: tensor [len]}}``."""

    def __init__(self, rows: dict[str, dict]):
        self.rows = rows

    def kv_batch_get(self, keys, partition_id, select_fields):
        from tensordict import NonTensorStack, TensorDict

        out = {}
        for field in select_fields:
            if field not in self.rows[keys[0]]:
                continue  # verl asks for ref_log_prob / values whether or not they exist
            values = [self.rows[k][field] for k in keys]
            out[field] = NonTensorStack(*values) if isinstance(values[0], str) else torch.nested.as_nested_tensor(
                values, layout=torch.jagged)
        return TensorDict(out, batch_size=len(keys))

    def kv_batch_put(self, keys, partition_id, fields):
        for i, key in enumerate(keys):
            for field in fields.keys():  # noqa: SIM118 - TensorDict keys
                self.rows[key][field] = fields[field][i].clone()
        return BatchMeta(keys=keys, partition_id=partition_id)


class BatchMeta(types.SimpleNamespace):
    def __len__(self):
        return len(self.keys)


def _step_tensors():
    g = torch.Generator().manual_seed(7)
    old = -torch.rand(B, R, generator=g) * 2
    rollout = old + 0.4 * torch.randn(B, R, generator=g)
    rollout[2, 1] = old[2, 1] - 3.0  # ρ = e³: outside IcePop's band
    mask = (torch.arange(R)[None] < torch.tensor(LENGTHS)[:, None]).float()
    return old, rollout, mask


def _step_rows(old, rollout, extra=lambda i, n: {}):
    """The step's rows as verl's queue holds them, keyed ``{uid}_{session}_{turn}`` (one session each): the response
    mask, the reward on the last token, π_old and μ, plus ``extra(i, n)`` per row."""
    keys = [f"{uid}_{i}_0" for i, uid in enumerate(UIDS)]
    rows = {}
    for i, key in enumerate(keys):
        n = LENGTHS[i]
        scores = torch.zeros(n)
        scores[-1] = SCORES[i]
        rows[key] = {"uid": UIDS[i], "response_mask": torch.ones(n), "rm_scores": scores,
                     "old_log_probs": old[i, :n], "rollout_log_probs": rollout[i, :n], **extra(i, n)}
    return keys, rows


@pytest.fixture(scope="module")
def trainer_base():
    """verl's v1 trainer module; ``transfer_queue`` stubbed for the import when it is not installed."""
    if importlib.util.find_spec("transfer_queue") is None:
        stub = types.ModuleType("transfer_queue")
        stub.KVBatchMeta = type("KVBatchMeta", (), {})
        sys.modules.setdefault("transfer_queue", stub)
    from verl.trainer.ppo.v1 import trainer_base, trainer_sync  # noqa: F401  (registers "sync")

    return trainer_base


def _compute_advantage(cls, trainer_base, monkeypatch, queue, keys) -> dict:
    """Run ``cls._compute_advantage`` (GRPO, n = 3) on the stand-in queue; the metrics it logged."""
    from omegaconf import OmegaConf

    monkeypatch.setattr(trainer_base, "tq", queue)
    trainer = object.__new__(cls)  # the method under test reads only the config (and the queue)
    trainer.config = OmegaConf.create({
        "algorithm": {"use_kl_in_reward": False, "adv_estimator": "grpo", "gamma": 1.0, "lam": 1.0,
                      "norm_adv_by_std_in_grpo": True, "rollout_correction": None},
        "actor_rollout_ref": {"rollout": {"n": 3}},
    })
    metrics: dict = {}
    trainer._compute_advantage(BatchMeta(keys=keys, partition_id="train"), metrics)
    return metrics


def test_plugin_trainer_applies_the_correction_after_verls_advantages(trainer_base, monkeypatch):

    from offpolicy.integrations.verl import plugin

    monkeypatch.setenv("OFFPOLICY_VERL", json.dumps({"correction": CORRECTION}))
    assert plugin.register_trainer() == "offpolicy"
    cls = trainer_base.get_trainer_cls("offpolicy")
    assert issubclass(cls, trainer_base.get_trainer_cls("sync"))

    old, rollout, mask = _step_tensors()
    keys, rows = _step_rows(old, rollout)
    queue = StandInQueue(rows)
    metrics = _compute_advantage(cls, trainer_base, monkeypatch, queue, keys)

    def stored(field):
        return torch.stack([torch.nn.functional.pad(rows[k][field].float(), (0, R - len(rows[k][field])))
                            for k in keys])

    advantages = stored("advantages")
    # GRPO by hand: group p0 scores (1, 0, 1): mean 2/3, std (unbiased) 0.5774 → A = (0.5774, −1.1547, 0.5774)
    assert advantages[:3, 0].tolist() == pytest.approx([0.57735, -1.15470, 0.57735], abs=1e-4)
    weights, keep, expected_metrics = rollout_correction(old, rollout, mask, CORRECTION, advantages=advantages)
    torch.testing.assert_close(stored("response_mask"), (mask.bool() & keep).float())
    torch.testing.assert_close(stored("rollout_is_weights"), weights * (mask.bool() & keep))
    assert 0 < stored("response_mask").sum() < mask.sum()  # something dropped, not everything
    assert stored("response_mask")[2, 1] == 0  # IcePop's token
    assert set(expected_metrics) <= set(metrics) and all(isinstance(v, float) for v in metrics.values())
    assert all(k.startswith("rollout_corr/") for k in expected_metrics)


def test_plugin_trainer_applies_the_binary_kl_gate_by_name(trainer_base, monkeypatch):
    # FlashREINFORCE's trust region by name in the plug-in's settings: gated_is on the sequence-mean binary KL between
    # μ and π_old. The step's sequence means are 0.023, 0.386, 0.259, 0.013, 0.029, 0.023: δ = 0.1 drops rows 1
    # and 2, and every kept token keeps its own ratio π_old/μ as verl's rollout_is_weights
    from offpolicy.integrations.verl import plugin

    gate = {"name": "gated_is", "level": "geometric", "gating": "binary_kl", "upper": 0.1}
    monkeypatch.setenv("OFFPOLICY_VERL", json.dumps({"correction": gate}))
    assert plugin.register_trainer() == "offpolicy"
    cls = trainer_base.get_trainer_cls("offpolicy")
    old, rollout, mask = _step_tensors()
    keys, rows = _step_rows(old, rollout)
    metrics = _compute_advantage(cls, trainer_base, monkeypatch, StandInQueue(rows), keys)

    def stored(field):
        return torch.stack([torch.nn.functional.pad(rows[k][field].float(), (0, R - len(rows[k][field])))
                            for k in keys])

    kept_rows = stored("response_mask").sum(-1) > 0
    assert kept_rows.tolist() == [True, False, False, True, True, True]
    rho = torch.exp(old - rollout)
    torch.testing.assert_close(stored("rollout_is_weights"), rho * stored("response_mask"))
    assert metrics["rollout_corr/gated_is/masked_seq_frac"] == pytest.approx(2 / 6)


def _verl_algorithm(**rollout_correction):
    """verl 0.9.1's own ``algorithm`` block (its generated ppo_trainer.yaml) with ``rollout_correction`` overrides."""
    import pathlib

    from omegaconf import OmegaConf

    config = OmegaConf.load(pathlib.Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml")
    for key, value in rollout_correction.items():
        config.algorithm.rollout_correction[key] = value
    return config


def test_a_double_correction_is_refused_naming_both_keys(trainer_base, monkeypatch):
    from offpolicy.integrations.verl import plugin
    from offpolicy.integrations.verl.driver import refuse_double_correction

    tis = parse_settings({"correction": {"name": "tis", "upper": 2.0}})
    default = _verl_algorithm()
    assert default.algorithm.rollout_correction.rollout_is is None  # verl's default: its own correction off
    refuse_double_correction(default.algorithm, tis)  # nothing to refuse
    for key, value in (("rollout_is", "token"), ("rollout_rs", "token_k1")):
        with pytest.raises(ValueError, match=rf"^algorithm\.rollout_correction\.{key}='{value}' and "
                                             r"OFFPOLICY_VERL's correction are both set: [^\n]*$"):
            refuse_double_correction(_verl_algorithm(**{key: value}).algorithm, tis)
    both = _verl_algorithm(rollout_is="sequence", rollout_rs="seq_mean_k3").algorithm
    with pytest.raises(ValueError, match="rollout_is='sequence' and algorithm.rollout_correction.rollout_rs="):
        refuse_double_correction(both, tis)
    refuse_double_correction(both, parse_settings({"sampling": {"min_p": 0.01}}))  # verl's alone, with DVP: fine

    # the trainer refuses at construction, before verl builds anything, and in a step if it was built otherwise
    monkeypatch.setenv("OFFPOLICY_VERL", json.dumps({"correction": {"name": "tis", "upper": 2.0}}))
    plugin.register_trainer()
    cls = trainer_base.get_trainer_cls("offpolicy")
    with pytest.raises(ValueError, match="rollout_correction.rollout_is='token' and OFFPOLICY_VERL's correction"):
        cls(config=_verl_algorithm(rollout_is="token"))
    trainer = object.__new__(cls)
    trainer.config = _verl_algorithm(rollout_rs="token_k1")
    with pytest.raises(ValueError, match="rollout_correction.rollout_rs='token_k1'"):
        trainer._compute_advantage(BatchMeta(keys=[], partition_id="train"), {})


def test_opsm_in_the_driver_reads_the_advantages():
    # OPSM drops a sequence only when A < 0 and its mismatch KL exceeds δ: the same tensors with the advantages'
    # signs flipped keep a different set of sequences
    old, rollout, mask = _step_tensors()
    settings = parse_settings({"correction": {"name": "opsm", "delta": 0.05}})
    a = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0])[:, None].expand(B, R)
    batch = {"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask}
    kept = apply_driver_correction({**batch, "advantages": a}, settings)[0]["response_mask"]
    flipped = apply_driver_correction({**batch, "advantages": -a}, settings)[0]["response_mask"]
    assert not torch.equal(kept, flipped)
    assert ((kept.sum(-1) == 0) <= (a[:, 0] < 0)).all()  # only A < 0 rows are dropped
    with pytest.raises(ValueError, match="advantages"):
        apply_driver_correction(batch, settings)


def test_settings_errors_name_the_key():
    with pytest.raises(ValueError, match="OFFPOLICY_VERL: sampling.min_p"):
        parse_settings({"sampling": {"min_p": 2.0}})
    with pytest.raises(ValueError, match="unknown correction 'tiss'"):
        parse_settings({"correction": "tiss"})
    with pytest.raises(ValueError, match="OFFPOLICY_VERL: alp"):
        parse_settings({"alp": {"sigma": 1.0}})
    with pytest.raises(ValueError, match="OFFPOLICY_VERL"):
        settings_from_text("{sampling: [")
    assert not settings_from_text("").any_engine_method


# ---------------------------------------------------------------------------------------------------------------
# Agent loop against a stub server
# ---------------------------------------------------------------------------------------------------------------

# the stub of verl's LLM server (PROMPT, RESPONSE, K, StubServer) is offpolicy_testkit/verl_stub.py, shared with
# tests/vllm/scripts/verl_server.py


def test_agent_loop_samples_under_the_recipe_and_carries_the_top_k():
    server = StubServer()
    loop = _agent_loop(server)
    # temperature 1: vLLM's prompt log-probs (the top-K) are the raw model's, the sampler's only at T = 1
    verl_params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
    output = asyncio.run(loop.run(dict(verl_params), priority=0, raw_prompt=[{"role": "user", "content": "hi"}]))

    generate, score = server.requests
    assert generate["sampling_params"] == {**verl_params, "min_p": 0.05, "top_k": 20}
    assert score["prompt_ids"] == PROMPT + RESPONSE  # the finished sequence, scored once
    assert score["sampling_params"] == {"temperature": 1.0, "top_k": 20, "top_p": 1.0, "min_p": 0.05,
                                        "max_tokens": 1, "prompt_logprobs": K}
    # response token j is predicted by row len(PROMPT) − 1 + j: its top id is 100 + 2 + j
    ids, logps = output.extra_fields["rollout_topk_ids"], output.extra_fields["rollout_topk_logprobs"]
    assert [row[0] for row in ids] == [102, 103, 104, 105]
    assert logps[0] == pytest.approx([-0.3, -3.0, -4.0])
    assert output.response_ids == RESPONSE and output.response_logprobs == [-0.5] * 4

    # what verl's TransferQueue agent loop stores: as_dict(), stacked by verl's own list_of_dict_to_tensordict
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    from offpolicy.integrations.verl.topk import TOPK_IDS_FIELD, TOPK_LOGP_FIELD

    stored = list_of_dict_to_tensordict([output.as_dict(), output.as_dict()])
    top_ids, top_lp = stored[TOPK_IDS_FIELD][0], stored[TOPK_LOGP_FIELD][0]
    assert top_ids.shape == (len(PROMPT) + len(RESPONSE), K) and top_ids.dtype == torch.int64
    # the engine's rolled layout: row len(PROMPT) − 1 + j predicts response token j
    assert top_ids[len(PROMPT) - 1:-1, 0].tolist() == [102, 103, 104, 105]
    torch.testing.assert_close(top_lp[len(PROMPT) - 1], torch.tensor([-0.3, -3.0, -4.0]))
    assert top_lp[-1].tolist() == [0.0, -math.inf, -math.inf]  # the rows no response token uses: a point mass
    assert "rollout_topk_ids" not in stored["extra_fields"][0]  # moved out of the non-tensor extra fields

    greedy = asyncio.run(loop.run({**verl_params, "temperature": 0.0}, raw_prompt=[]))
    assert "min_p" not in server.requests[2]["sampling_params"]  # validation's greedy requests stay greedy
    assert greedy.response_ids == RESPONSE

    sent = len(server.requests)
    with pytest.raises(ValueError, match="temperature 0.8.*raw model's at temperature 1"):
        asyncio.run(loop.run({**verl_params, "temperature": 0.8}, raw_prompt=[]))
    assert len(server.requests) == sent  # refused before anything is generated


def test_driver_trm_on_the_engines_top_k_bounds(trainer_base, monkeypatch):
    """``topk_logprobs`` + ``trm``: the plug-in trainer reads the engine's upper bound on KL(μ ‖ π_old) — a field laid
    out as the engine's log-probs over prompt + response — cuts it to the response as verl's ``response_from_nested``
    does, and TRM-Max masks every sequence with a token above δ."""

    from offpolicy.integrations.verl import plugin
    from offpolicy.integrations.verl.topk import KL_LOWER_FIELD, KL_UPPER_FIELD

    delta = 0.05
    correction = {"name": "trm", "max_kl": delta, "avg_kl": None}
    monkeypatch.setenv("OFFPOLICY_VERL", json.dumps({"correction": correction, "topk_logprobs": K}))
    plugin.register_trainer()
    cls = trainer_base.get_trainer_cls("offpolicy")
    old, rollout, mask = _step_tensors()
    upper = torch.full((B, R), 0.01)
    upper[1, 2] = 0.2  # > δ: sequence 1 is masked
    upper[4, 1] = 0.049  # just below δ: kept
    upper[3, 4] = 0.5  # the last token of a full-length row: masked
    n_prompt = 2
    def engine_rows(i, n):
        # engine layout: row n_prompt − 1 + j holds response token j's value; the prompt rows hold junk (9.0)
        seq = torch.cat([torch.full((n_prompt - 1,), 9.0), upper[i, :n], torch.tensor([9.0])])
        return {KL_UPPER_FIELD: seq, KL_LOWER_FIELD: torch.zeros(n_prompt + n)}

    keys, rows = _step_rows(old, rollout, engine_rows)
    metrics = _compute_advantage(cls, trainer_base, monkeypatch, StandInQueue(rows), keys)
    kept = torch.stack([torch.nn.functional.pad(rows[k]["response_mask"].float(), (0, R - LENGTHS[i]))
                        for i, k in enumerate(keys)])
    # by hand: row maxima over valid tokens 0.01, 0.2, 0.01, 0.5, 0.049, 0.01 → rows 1 and 3 out
    torch.testing.assert_close(kept, mask * torch.tensor([1.0, 0, 1, 0, 1, 1])[:, None])
    assert metrics["rollout_corr/trm/masked_seq_frac"] == pytest.approx(2 / 6)
    assert metrics["rollout_corr/trm/divergence_topk"] == 1.0
    # the same through the function the trainer calls
    direct = apply_driver_correction({"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask,
                                      "advantages": torch.ones(B, R), "token_divergence": upper * mask},
                                     parse_settings({"correction": correction, "topk_logprobs": K}))[0]
    torch.testing.assert_close(direct["response_mask"], kept)
    with pytest.raises(ValueError, match="token_divergence"):  # top-K on, no bounds (e.g. verl's bypass mode)
        apply_driver_correction({"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask,
                                 "advantages": torch.ones(B, R)}, parse_settings({"correction": correction,
                                                                                  "topk_logprobs": K}))
    with pytest.raises(ValueError, match="OFFPOLICY_VERL: topk_bound"):
        parse_settings({"topk_bound": "exact"})


def test_the_example_config_parses():
    """``examples/verl_offpolicy.yaml``'s settings block, and its top-K TRM variant, are what the plug-in accepts."""
    import pathlib

    import yaml

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "verl_offpolicy.yaml"
    config = yaml.safe_load(path.read_text())
    env = config["ray_kwargs"]["ray_init"]["runtime_env"]["env_vars"]
    assert config["actor_rollout_ref"]["model"]["external_lib"] == env["VERL_USE_EXTERNAL_MODULES"]
    settings = settings_from_text(env["OFFPOLICY_VERL"])
    assert settings.sampling.min_p == 1e-3 and settings.alp is not None and settings.topk_bound == "upper"
    block = yaml.safe_load(env["OFFPOLICY_VERL"])
    block["correction"].append({"name": "trm", "max_kl": 0.05, "avg_kl": None})
    assert parse_settings({**block, "topk_logprobs": 20}).topk_logprobs == 20


def test_sequence_topk_layout_and_errors():
    from offpolicy.integrations.verl.topk import sequence_topk, topk_rows

    # prompt of 3, response of 2 with K = 2: rows 2 and 3 hold the response tokens' top-K, rows 0, 1, 4 a point mass
    lp, ids = sequence_topk(3, [[5, 9], [7, 1]], [[-0.1, -2.5], [-0.3, -1.5]], 2)
    assert ids.tolist() == [[0, 1], [0, 1], [5, 9], [7, 1], [0, 1]]
    assert lp[2].tolist() == pytest.approx([-0.1, -2.5]) and lp[4].tolist() == [0.0, -math.inf]
    assert sequence_topk(2, [], [], 3)[1].shape == (2, 3)  # an empty response: the prompt rows only
    with pytest.raises(ValueError, match="position 1"):
        sequence_topk(3, [[5, 9], [7, 7]], [[-0.1, -2.5], [-0.3, -1.5]], 2)  # a repeated id
    with pytest.raises(ValueError, match="n_prompt"):
        sequence_topk(0, [[5]], [[-0.1]], 1)
    with pytest.raises(ValueError, match="sample 1 has 2 rows for a sequence of 3"):
        topk_rows([lp, lp[:2]], [ids, ids[:2]], [5, 3], [False, False])
    out_lp, _ = topk_rows([lp, lp[:2]], [ids, ids[:2]], [5, 3], [False, True])  # a padding sample: a point mass
    assert out_lp.shape == (8, 2) and out_lp[5:].tolist() == [[0.0, -math.inf]] * 3


def test_top_k_parse_errors_name_the_field():
    from offpolicy.integrations.verl.agent_loop import topk_from_prompt_logprobs

    with pytest.raises(ValueError, match="prompt_logprobs"):
        topk_from_prompt_logprobs({}, 3, 2, K)
    rows = prompt_logprobs_rows(5)
    rows["prompt_logprobs"][3] = [-0.1, None, None]  # a position where the server returned fewer than K
    with pytest.raises(ValueError, match="row 3"):
        topk_from_prompt_logprobs(rows, 3, 2, K)
    assert math.isfinite(topk_from_prompt_logprobs(prompt_logprobs_rows(5), 3, 2, K)[1][0][0])


def test_plugin_registers_the_policy_losses():
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    from offpolicy.integrations.verl import plugin

    names = plugin.registered()["policy_loss"].split(", ")
    assert {"offpolicy", "offpolicy_cispo", "offpolicy_sapo", "offpolicy_dppo_tv", "offpolicy_gspo"} <= set(names)
    # these read μ, which verl's policy-loss call does not carry: the plug-in's engine supplies it (test_verl_actor)
    assert {"offpolicy_ipo", "offpolicy_bypass", "offpolicy_m2po"} <= set(names)
    with pytest.raises(ValueError, match="rollout_log_probs: μ, read by ipo"):  # called without the engine: refused
        get_policy_loss_fn("offpolicy_ipo")(torch.zeros(1, 3), torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3))
    old, new = torch.zeros(1, 3), torch.tensor([[0.5, 0.0, -0.5]], requires_grad=True)
    loss, metrics = get_policy_loss_fn("offpolicy")(old, new, torch.ones(1, 3), torch.ones(1, 3), "token-mean",
                                                     {"clip_ratio": 0.2})
    # PPO, A = 1: r = (e^0.5, 1, e^-0.5); the first clips at 1.2 → −(1.2 + 1 + 0.6065) / 3 = −0.9355
    assert loss.item() == pytest.approx(-(1.2 + 1.0 + math.exp(-0.5)) / 3, rel=1e-5)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1 / 3)


def test_corrected_writes_a_dataproto_in_place():
    from verl import DataProto

    from offpolicy.integrations.verl.driver import corrected

    old, rollout, mask = _step_tensors()
    a = torch.tensor(SCORES)[:, None].expand(B, R) - 0.5
    data = DataProto.from_single_dict({"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask,
                                       "advantages": a.contiguous()})
    settings = parse_settings({"correction": CORRECTION})
    expected, _ = apply_driver_correction({"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask,
                                           "advantages": a}, settings)
    metrics = corrected(data, settings)
    torch.testing.assert_close(data.batch["response_mask"], expected["response_mask"])
    torch.testing.assert_close(data.batch["rollout_is_weights"], expected["rollout_is_weights"])
    assert metrics and all(isinstance(v, float) for v in metrics.values())


@pytest.mark.parametrize(("quadrants", "tau"), [(False, 0.05), (True, 0.12)], ids=["areal", "quadrants"])
def test_m2po_in_the_driver_after_verls_advantages(trainer_base, monkeypatch, quadrants, tau):
    # M2PO in AReaL's form (log π_old − log μ: the driver has both) through verl's real _compute_advantage: the
    # stored mask drops the tokens with the largest (log π_old − log μ)² — among PPO's active quadrants of verl's own
    # advantages when quadrants=True — until the second moment of the rest is ≤ τ (arXiv 2510.01161, Algorithm 1).
    # The 23 valid tokens: M2 = 0.533 (one (log r)² = 9); the 10 non-candidates alone have 1.21 / 10, so with quadrants
    # τ = 0.12 is reachable: drop 9 → 3.26 / 22 = 0.148, drop 0.845 → 2.41 / 21 = 0.115 ≤ 0.12: two dropped
    from offpolicy.integrations.verl import plugin

    correction = {"name": "m2po", "threshold": tau, "source": "mismatch", "quadrants": quadrants}
    monkeypatch.setenv("OFFPOLICY_VERL", json.dumps({"correction": correction}))
    cls = trainer_base.get_trainer_cls(plugin.register_trainer())
    old, rollout, mask = _step_tensors()
    keys, rows = _step_rows(old, rollout)
    metrics = _compute_advantage(cls, trainer_base, monkeypatch, StandInQueue(rows), keys)

    def stored(field):
        return torch.stack([torch.nn.functional.pad(rows[k][field].float(), (0, R - len(rows[k][field])))
                            for k in keys])

    kept, valid = stored("response_mask").bool(), mask.bool()
    dropped = valid & ~kept
    m2 = (old - rollout) ** 2
    a = stored("advantages")
    candidates = valid if not quadrants else valid & (((a > 0) & (old > rollout)) | ((a < 0) & (old < rollout)))
    assert bool((dropped <= candidates).all()) and 0 < int(dropped.sum()) < int(candidates.sum())
    assert float(m2[kept].mean()) <= tau < float(m2[valid].mean())
    # the fewest: every dropped token's (log r)² ≥ every kept candidate's, and keeping back the smallest dropped one
    # would break the bound
    assert float(m2[dropped].min()) >= float(m2[kept & candidates].max())
    smallest = m2[dropped].min()
    assert float((m2[kept].sum() + smallest) / (kept.sum() + 1)) > tau
    assert metrics["rollout_corr/m2po/masked_frac"] == pytest.approx(float(dropped.sum() / valid.sum()))
    if quadrants:
        assert int(dropped.sum()) == 2
    torch.testing.assert_close(stored("rollout_is_weights"), kept.float())
