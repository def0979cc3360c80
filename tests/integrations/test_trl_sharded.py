"""Sharded trainers in one process: how the TRL plug-in tells ZeRO-3 / FSDP1 / FSDP2 apart (accelerate's plan or the
model's own parameters), refuses the options that read the output head under ZeRO-3 and FSDP1 at construction — one
line naming the option and the sharding — and again at the forward, refuses ALP under ZeRO-3 (σ in the optimiser),
puts σ on accelerate's device, and leaves a sharded or 0-element trainer tensor out of the sync check's parameter
count.

ZeRO-3's parameters are a stand-in here (the real ones: ``test_trl_zero3_ranks.py``, where DeepSpeed is installed):
the attributes DeepSpeed's ``deepspeed/runtime/zero/partition_parameters.py`` gives a partitioned parameter
(``_convert_to_deepspeed_param``: ``ds_id``, ``ds_status``, ``ds_shape``, ``ds_numel``, ``ds_tensor`` the rank's flat
partition) with its ``data`` a 0-element tensor (``partition``: ``param.data = torch.empty(0)``) outside a gather.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from offpolicy.integrations.trl.parts.alp import ALPWiring
from offpolicy.integrations.trl.parts.scoring import _backbone_and_head
from offpolicy.integrations.trl.parts.sharding import gathered_head, head_options, model_sharding, refuse_sharded_head
from offpolicy.models.tiny import build_tiny_model
from offpolicy.rollout.param_check import ParameterCheck


def zero3_stand_in(model: torch.nn.Module, *, rank: int = 0, world: int = 2, empty: bool = True) -> torch.nn.Module:
    """``model``'s parameters as ZeRO-3 leaves them outside a gather (``empty=False``: the attributes only, the data
    kept — a model under ``zero.Init`` as TRL's constructor sees it is already empty, but TRL's constructor reads
    the data on CPU here)."""
    for i, p in enumerate(model.parameters()):
        if hasattr(p, "ds_id"):  # tied: one parameter under two names
            continue
        flat = p.data.reshape(-1)
        per = -(-flat.numel() // world)
        p.ds_id, p.ds_status, p.ds_shape, p.ds_numel = i, "NOT_AVAILABLE", p.shape, p.numel()
        p.ds_tensor = flat[rank * per:(rank + 1) * per].clone()
        if empty:
            p.data = torch.empty(0, dtype=p.dtype)
    return model


def _plan(zero_stage=None, fsdp_version=None):
    ds = SimpleNamespace(zero_stage=zero_stage) if zero_stage is not None else None
    fsdp = SimpleNamespace(fsdp_version=fsdp_version) if fsdp_version is not None else None
    return SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=ds, fsdp_plugin=fsdp), device=torch.device("cpu"))


def test_the_sharding_comes_from_accelerates_plan_or_the_model():
    model, _ = build_tiny_model(seed=0)
    assert model_sharding(model) is None and model_sharding(model, _plan(zero_stage=2)) is None
    assert model_sharding(model, _plan(zero_stage=3)) == "zero3"
    assert model_sharding(model, _plan(fsdp_version=1)) == "fsdp1"
    assert model_sharding(model, _plan(fsdp_version=2)) == "fsdp2"
    assert model_sharding(zero3_stand_in(model)) == "zero3"


@pytest.mark.parametrize("sharding, named", [("zero3", "ZeRO-3"), ("fsdp1", "FSDP1")])
@pytest.mark.parametrize("options, first", [
    ({"sampling_replay": True}, "sampling_replay=True"),
    ({"dvp_rho": 0.05}, "dvp_rho=0.05"),
    ({"topk_logprobs": 4}, "topk_logprobs=4"),
    ({"topk_logprobs": 4, "score_centering": True}, "topk_logprobs=4"),
])
def test_head_options_are_refused_under_zero3_and_fsdp1_naming_both(sharding, named, options, first):
    with pytest.raises(ValueError) as err:
        refuse_sharded_head(head_options(**options), sharding)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{first} reads the output head, which {named} shards")
    refuse_sharded_head(head_options(**options), "fsdp2")  # gathered
    refuse_sharded_head(head_options(**options), None)


def test_a_zero3_placeholder_head_is_refused_at_the_forward_not_read():
    model = zero3_stand_in(build_tiny_model(seed=0)[0])
    with pytest.raises(ValueError, match="lm_head.weight is a ZeRO-3 placeholder .*not supported under ZeRO-3"):
        _backbone_and_head(model)
    flat = torch.zeros(7)  # an FSDP1 flat shard's 1-D view of the head
    with pytest.raises(ValueError, match=r"lm_head.weight has shape \(7,\).*FSDP1"):
        gathered_head(flat, None)
    w, b = torch.ones(3, 2), torch.zeros(3)
    assert gathered_head(w, b) == (w, b)  # unsharded: the head itself


@pytest.mark.parametrize("case", ["zero3 placeholder", "meta", "sharded tensor"])
def test_sync_check_counts_sharded_and_placeholder_trainer_tensors_as_not_judged(case):
    trainer_tensor = {
        "zero3 placeholder": lambda: zero3_stand_in(torch.nn.Linear(4, 1, bias=False)).weight.detach(),  # 0 elements
        "meta": lambda: torch.empty(4, device="meta"),
        "sharded tensor": lambda: SimpleNamespace(local_shards=lambda: [], numel=lambda: 4),  # FSDP1's ShardedTensor
    }[case]()
    engine = {"a": torch.ones(4), "x": torch.ones(4)}
    trainer = {"a": torch.ones(4), "x": trainer_tensor}
    check = ParameterCheck()
    check.calibrate(engine.items(), trainer)
    assert (check.checked, check.total) == (1, 2)
    trainer["a"] = torch.full((4,), 2.0)  # "a" is still judged: left behind by a sync that did not take
    assert check.after_sync(engine.items(), trainer) == ["a"]


def _wiring(model, accelerator):
    w = ALPWiring()
    w.model, w.accelerator, w.args = model, accelerator, SimpleNamespace(delta=None)
    return w


def test_alp_sigma_lives_on_accelerates_device():
    model, _ = build_tiny_model(seed=0)  # its parameters on the CPU (offloaded), its forward on the accelerator
    plan = _plan()
    plan.device = torch.device("meta")  # a device other than the parameters', available on every machine
    w = _wiring(model, plan)
    w._setup_alp({}, "token_mean", {"clip_low": None, "clip_high": None, "dual_clip": None})
    assert w.offpolicy_alp.log_sigma.device.type == "meta"


def test_alp_is_refused_under_zero3():
    model = zero3_stand_in(build_tiny_model(seed=0)[0], empty=False)
    for accelerator in (_plan(), _plan(zero_stage=3)):
        with pytest.raises(ValueError, match="^alp=: σ is a parameter outside the model.*ZeRO-3"):
            _wiring(model, accelerator)._setup_alp({}, "token_mean", {"clip_low": None, "clip_high": None,
                                                                      "dual_clip": None})
    _wiring(build_tiny_model(seed=0)[0], _plan(fsdp_version=2))._setup_alp(
        {}, "token_mean", {"clip_low": None, "clip_high": None, "dual_clip": None})  # FSDP2: allowed


@pytest.mark.slow
@pytest.mark.parametrize("kw, first", [({"sampling_replay": True}, "sampling_replay=True"),
                                       ({"dvp_rho": 0.05}, "dvp_rho=0.05")])
def test_the_trainer_refuses_head_options_under_zero3_at_construction(tmp_path, kw, first):
    trl = pytest.importorskip("trl")
    pytest.importorskip("datasets")
    if not trl.__version__.startswith("1.16"):
        pytest.skip(f"the plug-in targets TRL 1.16; installed {trl.__version__}")
    from offpolicy_testkit.trl_toy import toy_dataset, varied_reward
    from trl import GRPOConfig

    from offpolicy.integrations.trl import OffPolicyGRPOTrainer

    model, tok = build_tiny_model(seed=0)
    zero3_stand_in(model, empty=False)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, max_steps=1, report_to=[], use_cpu=True, bf16=False, save_strategy="no",
                      beta=0.0)
    with pytest.raises(ValueError, match=f"^{first} reads the output head, which ZeRO-3 shards"):
        OffPolicyGRPOTrainer(model=model, reward_funcs=varied_reward, args=args, train_dataset=toy_dataset(),
                             processing_class=tok, **kw)
