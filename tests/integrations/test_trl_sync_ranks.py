"""TRL's sync check with two processes (gloo, the tiny model sharded over both ranks by FSDP2): every rank runs the
probe's trainer forward at the same points — under FSDP that forward all-gathers the parameters, so a rank that
skipped it would leave the main one waiting forever. In server mode the main process scores the engine and judges; when its check fails, every rank raises."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from offpolicy_testkit.gloo_ranks import run_ranks

HERE = Path(__file__).resolve()


def run_rank(rank: int, world: int, port: int, out: str) -> None:
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from offpolicy.integrations.trl.vllm_sync import TRLSyncCheck
    from offpolicy.models.tiny import build_tiny_model
    from offpolicy.rollout.scoring import sequence_logprobs
    from offpolicy.rollout.sync_check import SyncCheck, SyncCheckError

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, tok = build_tiny_model(seed=0)
        reference, _ = build_tiny_model(seed=0)  # the engine: a full copy, on the main rank only
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)

        class Engine:
            def score(self, prompt_ids, completion_ids):
                with torch.no_grad():
                    return sequence_logprobs(reference, prompt_ids, completion_ids)

        pushes = {"take": True}

        def push():  # the engine takes the trainer's new weights (gathered: full tensors on every rank)
            from torch.distributed.tensor import DTensor

            full = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()}
            if rank == 0 and pushes["take"]:
                reference.load_state_dict(full)

        generation = SimpleNamespace(model=model, mode="server",
                                     accelerator=SimpleNamespace(is_main_process=rank == 0))
        logged: list = []
        hook = TRLSyncCheck(generation, model, SyncCheck(), push=push, step=lambda: 1, log=logged.append,
                            tokenizer=tok)
        hook.scorer = Engine()
        hook()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        hook()
        with torch.no_grad():  # a third sync that the engine does not take: the main rank's check fails
            for p in model.parameters():
                p.add_(0.01)
        pushes["take"] = False
        error = None
        try:
            hook()
        except SyncCheckError as err:
            error = str(err)
        Path(out, f"rank{rank}.json").write_text(json.dumps({"logged": logged, "error": error}))
    finally:
        dist.barrier()  # neither rank tears its group down while the other still reads from it
        dist.destroy_process_group()


def test_every_rank_joins_the_check_under_fsdp_and_raises_when_it_fails(tmp_path):
    run_ranks(HERE, tmp_path, hung="a rank hung: the check's trainer forward did not complete on every rank")
    main = json.loads((tmp_path / "rank0.json").read_text())
    other = json.loads((tmp_path / "rank1.json").read_text())
    logged = main["logged"]
    assert len(logged) == 2 and all(m["sync/ok"] == 1.0 for m in logged)  # the first two syncs judged, both took
    assert logged[-1]["sync/gap"] < 1e-5 and logged[-1]["sync/step_rms"] > 0  # fp32 both sides; the weights moved
    assert other["logged"] == []  # the other rank joined the forwards and judged nothing
    # the third sync did not take: the main rank's check raised, and the other rank raised the same, naming rank 0
    assert main["error"] is not None and "did not take" in main["error"]
    assert other["error"] == f"rank 0: {main['error']}"


if __name__ == "__main__":
    run_rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    # the rank's verdict is written and its group destroyed; leave without the interpreter's teardown, where gloo's
    # worker threads are sometimes still joinable as their C++ objects are destroyed ("terminate called without an
    # active exception", about 1 run in 5 on this CPU, after the test's work was done)
    sys.stdout.flush()
    os._exit(0)
