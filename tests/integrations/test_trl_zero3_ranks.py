"""The TRL plug-in under DeepSpeed ZeRO-3 on two CPU processes (``DS_ACCELERATOR=cpu``, gloo; the embedded tiny model):
outside a gather every parameter is a 0-element placeholder (its ``state_dict()`` too), so the options that read the
output head refuse it in one line naming ZeRO-3 (before: a shape error inside the head pass), the sync check's
parameter layer judges none of those tensors, and ALP's σ would be all-reduced over the engine's data-parallel group.

Skipped where DeepSpeed is not installed (``pip install deepspeed==0.19.8``); it builds none of DeepSpeed's C++ ops
(torch's AdamW, gloo's collectives)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
from offpolicy_testkit.trl_scoring import run_two_ranks

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve()


def run_rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    import deepspeed
    import torch
    import torch.distributed as dist
    from offpolicy_testkit.trl_scoring import scoring_part

    from offpolicy.integrations.trl.parts.sharding import model_sharding, training_groups
    from offpolicy.models.tiny import build_tiny_model
    from offpolicy.rollout.param_check import ParameterCheck
    from offpolicy.rollout.sampling import SamplingConfig

    # gloo alone carries the collectives: DeepSpeed's shared-memory op is a C++ build of minutes on first use
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    result: dict = {}
    try:
        model, _ = build_tiny_model(seed=0)
        reference, _ = build_tiny_model(seed=0)  # the engine's tensors: whole
        config = {"train_micro_batch_size_per_gpu": 1,
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        head = model.lm_head.weight
        result["head"] = {"shape": list(head.shape), "ds_shape": list(head.ds_shape), "has_ds_tensor":
                          hasattr(head, "ds_tensor")}
        result["sharding"] = [model_sharding(model), model_sharding(engine)]
        result["groups"] = [dist.get_world_size(g) for g in training_groups(engine)]
        ids = torch.randint(5, 4000, (2, 8), generator=torch.Generator().manual_seed(rank))
        try:
            scoring_part(SamplingConfig(top_k=20), False)._offpolicy_scores(model, ids, torch.ones_like(ids), 4)
            result["error"] = None
        except Exception as err:  # noqa: BLE001 - the test names what was raised (a shape error is the bug)
            result["error"] = f"{type(err).__name__}: {err}"
        check = ParameterCheck()
        check.calibrate(reference.named_parameters(), model.state_dict())
        result["params"] = [check.checked, check.total]
        with deepspeed.zero.GatheredParameters([head]):  # gathered, the head is whole
            result["gathered"] = list(head.shape)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def test_zero3_head_options_refuse_placeholders_and_the_parameter_layer_judges_none(tmp_path):
    if importlib.util.find_spec("deepspeed") is None:  # not imported here: DeepSpeed picks its accelerator on import
        pytest.skip("DeepSpeed is not installed (pip install deepspeed==0.19.8)")
    results = run_two_ranks(HERE, tmp_path, env={"DS_ACCELERATOR": "cpu"})
    for result in results:
        assert result["head"] == {"shape": [0], "ds_shape": [4099, 128], "has_ds_tensor": True}
        assert result["gathered"] == [4099, 128]
        assert result["sharding"] == ["zero3", "zero3"] and result["groups"] == [2]
        error = result["error"]
        assert error is not None and error.startswith("ValueError: lm_head.weight is a ZeRO-3 placeholder")
        assert "\n" not in error
        checked, total = result["params"]
        assert total > 0 and checked == 0  # every trainer tensor a placeholder: none judged


if __name__ == "__main__":
    run_rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    sys.stdout.flush()  # the verdicts are written: leave without the interpreter's teardown (gloo's threads)
    os._exit(0)
