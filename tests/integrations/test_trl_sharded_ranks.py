"""The TRL plug-in's head-reading options on two processes (gloo, the embedded tiny model) sharded by FSDP2 and FSDP1.

FSDP2 (``fully_shard``, the tied head in the root's group; an untied head in a group of its own): sampling replay's
and top-k TRM / score centering's per-token values equal the unsharded model's, and the head's gradient equals the
average of the unsharded gradients of the two ranks' batches — what FSDP2 does to the model's own gradients (the
default ``full_tensor()`` gives each rank its own batch's gradient on its shard). ALP's σ gradient is averaged over the
model's own mesh, not the default group. FSDP1 (``FullyShardedDataParallel``): the head is refused in one line, not
read as a flat shard.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from offpolicy_testkit.trl_scoring import run_two_ranks, scoring_part

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve()


def _grad(weight):
    from torch.distributed.tensor import DTensor

    g = weight.grad
    return g.full_tensor() if isinstance(g, DTensor) else g


def _compare(rank, model, ref, ids, att, topk, recipe, centering):
    """Max |Δ| of the per-token values and of the head's gradient, sharded vs unsharded."""
    s = scoring_part(recipe, centering, bounds=recipe is None)  # with the engine's top-K: the centre and a TRM's bounds
    t_len = topk[0].shape[2]

    def engine_topk(r):  # the engine's top-K of rank r's batch, without a recipe (top-k TRM, score centering)
        return (topk[0][r], topk[1][r]) if recipe is None else None

    out = s._offpolicy_scores(model, ids[rank], att, t_len, topk=engine_topk(rank))
    (out.logp.sum() + (out.center.sum() if out.center is not None else 0)).backward()
    got = _grad(model.lm_head.weight)
    grads, want = [], None
    for r in range(2):  # the unsharded gradient of each rank's batch; FSDP averages them
        ref.zero_grad()
        o = s._offpolicy_scores(ref, ids[r], att, t_len, topk=engine_topk(r))
        (o.logp.sum() + (o.center.sum() if o.center is not None else 0)).backward()
        grads.append(ref.lm_head.weight.grad.clone())
        if r == rank:
            want = o
    values = [(out.logp, want.logp)]
    if out.center is not None:
        values += [(out.center, want.center), (out.kl_upper, want.kl_upper), (out.kl_lower, want.kl_lower)]
    return {"values": max(float((a.detach() - b.detach()).abs().max()) for a, b in values),
            "grad": float((got - (grads[0] + grads[1]) / 2).abs().max()),
            "grad_scale": float(grads[0].abs().max())}


def _sigma_reduced(rank, mesh):
    """σ's gradient (rank + 1 everywhere) after ALP's all-reduce on a tiny model ``fully_shard``-ed over ``mesh``
    (None: every rank), and the sizes of the groups it was averaged over."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from offpolicy.integrations.trl.alp import ALPSigmaHooks
    from offpolicy.integrations.trl.parts.sharding import training_groups
    from offpolicy.models.tiny import build_tiny_model
    from offpolicy.perturbation import LayerwisePerturbation

    model, _ = build_tiny_model(seed=0)
    fully_shard(model, mesh=mesh)
    alp = LayerwisePerturbation(model)
    alp.log_sigma.grad = torch.full_like(alp.log_sigma, float(rank + 1))
    ALPSigmaHooks(alp, lambda: model).on_pre_optimizer_step(None, None, None)
    return alp.log_sigma.grad.tolist(), [dist.get_world_size(g) for g in training_groups(model)]


def run_rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    from offpolicy.integrations.trl.parts.sharding import model_sharding, training_groups
    from offpolicy.models.tiny import build_tiny_model
    from offpolicy.rollout.sampling import SamplingConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result: dict = {}
    try:
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(5, 4000, (2, 3, 10), generator=g)  # each rank's own batch [3, 10]
        att = torch.ones(3, 10, dtype=torch.long)
        att[1, :2] = 0
        mu = torch.log_softmax(2 * torch.randn(2, 3, 4, 4099, generator=g), -1)  # the engine's top-K, K = 5
        topk = mu.topk(5, -1)
        for case, tied in (("tied", True), ("untied", False)):
            kw = {} if tied else {"tie_word_embeddings": False}
            model, _ = build_tiny_model(seed=0, **kw)
            ref, _ = build_tiny_model(seed=0, **kw)
            for layer in model.model.layers:
                fully_shard(layer)
            if not tied:
                fully_shard(model.lm_head)
            fully_shard(model)
            result["sharding"] = model_sharding(model)
            result[f"{case}/replay"] = _compare(rank, model, ref, ids, att, (topk.values, topk.indices),
                                                SamplingConfig(top_k=20, temperature=0.7), False)
            model.zero_grad()
            result[f"{case}/topk"] = _compare(rank, model, ref, ids, att, (topk.values, topk.indices), None, True)

        # ALP's σ: averaged over the model's own mesh (here a group of one: each rank trains its own model)
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "shard"))
        for name, shard_mesh in (("alone", mesh["shard"]), ("shared", None), ("hsdp", mesh)):
            # alone: each rank's own model; shared: sharded over both; hsdp: replicated over both, sharded over one
            result[f"sigma_{name}"], result[f"groups_{name}"] = _sigma_reduced(rank, shard_mesh)

        # FSDP1: the head is refused, not read as a flat shard
        flat, _ = build_tiny_model(seed=0)
        wrapped = FullyShardedDataParallel(flat, use_orig_params=True, device_id=torch.device("cpu"))
        result["fsdp1_sharding"] = model_sharding(wrapped)
        result["fsdp1_groups"] = [dist.get_world_size(gr) for gr in training_groups(wrapped)]
        try:
            scoring_part(SamplingConfig(top_k=20), False)._offpolicy_scores(wrapped.module, ids[rank], att, 4)
            result["fsdp1_error"] = None
        except Exception as err:  # noqa: BLE001 - the test names what was raised (a shape error is the bug)
            result["fsdp1_error"] = f"{type(err).__name__}: {err}"
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_two_ranks(HERE, tmp_path_factory.mktemp("sharded"))


@pytest.mark.parametrize("case", ["tied/replay", "tied/topk", "untied/replay", "untied/topk"])
def test_fsdp2_head_options_give_the_unsharded_values_and_the_averaged_head_gradient(ranks, case):
    for result in ranks:
        assert result["sharding"] == "fsdp2"
        r = result[case]
        assert r["values"] < 1e-5  # the gathered head: the same per-token values
        assert r["grad_scale"] > 1e-2 and r["grad"] < 1e-5 * max(1.0, r["grad_scale"])


def test_alp_sigma_grad_is_averaged_over_the_group_the_model_trains_in(ranks):
    for rank, result in enumerate(ranks):
        assert result["groups_alone"] == [1]
        assert set(result["sigma_alone"]) == {float(rank + 1)}  # a model of its own: nothing to average with
        assert set(result["sigma_shared"]) == {1.5}  # sharded over both ranks: the mean of 1 and 2
        assert result["groups_hsdp"] == [2, 1] and set(result["sigma_hsdp"]) == {1.5}  # each mesh dimension in turn


def test_fsdp1_head_is_refused_in_one_line(ranks):
    for result in ranks:
        assert result["fsdp1_sharding"] == "fsdp1" and result["fsdp1_groups"] == [2]
        error = result["fsdp1_error"]
        assert error is not None and error.startswith("ValueError: ") and "\n" not in error
        assert "FSDP1" in error and "lm_head" in error


if __name__ == "__main__":
    run_rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    sys.stdout.flush()  # the verdicts are written: leave without the interpreter's teardown (gloo's threads)
    os._exit(0)
