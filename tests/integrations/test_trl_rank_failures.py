"""An exception on one rank reaches every rank (two processes over gloo): inside the TRL plug-in's per-sync and
per-step blocks (:func:`offpolicy.integrations.trl.ranks.every_rank_raises`) a rank that fails makes the others
raise its error, naming it, instead of leaving them blocked in TRL's next collective — a dead server's refused
weight push, a hung server's probe past its timeout, an error of a type that cannot be rebuilt; a failed rank
whose peer never comes raises alone after ``FAILED_RANK_WAIT``. The loss's extra work is wrapped too."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
from offpolicy_testkit.gloo_ranks import run_ranks

HERE = Path(__file__).resolve()


class Unbuildable(Exception):
    """An error whose type takes more than a message: another rank cannot rebuild it."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"code {code}: {detail}")


def _outcome(call) -> dict:
    try:
        call()
    except Exception as err:  # noqa: BLE001 - the outcome is what the test compares
        return {"type": type(err).__name__, "text": str(err)}
    return {"type": None, "text": None}


def run_rank(rank: int, world: int, port: int, out: str) -> None:
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from offpolicy.integrations.trl import ranks
    from offpolicy.integrations.trl.vllm_sync import ServerScorer, TRLSyncCheck
    from offpolicy.models.tiny import build_tiny_model
    from offpolicy.rollout.http import ServerError
    from offpolicy.rollout.scoring import sequence_logprobs
    from offpolicy.rollout.sync_check import SyncCheck

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: dict = {}
    try:
        def fails_on(bad: int, error: Exception):
            def block():
                with ranks.every_rank_raises():
                    if rank == bad:
                        raise error
            return block

        for i in range(20):  # healthy blocks raise nothing (and their verdicts are cleaned up behind them)
            assert _outcome(fails_on(-1, ValueError()))["type"] is None, i
        results["value_error"] = _outcome(fails_on(1, ValueError("probe row 2: bad")))
        results["unbuildable"] = _outcome(fails_on(0, Unbuildable(7, "lost")))
        results["after"] = _outcome(fails_on(-1, ValueError()))  # the run goes on when the error was caught

        # a dead server: the main rank's weight push is refused; the other rank pushed nothing and stops too
        def refused():
            if rank == 0:
                raise ServerError("vllm weight reload /pause: cannot reach http://127.0.0.1:9/pause (refused)")

        generation = SimpleNamespace(mode="server", server_timeout=0.5,
                                     accelerator=SimpleNamespace(is_main_process=rank == 0))
        model, tok = build_tiny_model(seed=0)
        results["push"] = _outcome(TRLSyncCheck(generation, model, None, push=refused, step=lambda: 1,
                                                log=lambda m: None))

        # a hung server: the main rank's probe gets no answer within the timeout (TRL's client waits forever)
        class Hung:
            base_url = "http://127.0.0.1:8000"

            def get_sequence_logprobs(self, *args, **kwargs):
                threading.Event().wait()

        hook = TRLSyncCheck(generation, model, SyncCheck(), push=lambda: None, step=lambda: 1, log=lambda m: None,
                            tokenizer=tok)
        class Answers:  # the engine holds the trainer's own weights
            def score(self, prompt_ids, completion_ids):
                with torch.no_grad():
                    return sequence_logprobs(model, prompt_ids, completion_ids)

        hook.scorer = Answers()
        hook()  # sync 1: the check is calibrated on the main rank by a scorer that answers, and passes
        hook.scorer = ServerScorer(Hung(), timeout=0.5, sync=lambda: hook.syncs)
        results["probe"] = _outcome(hook)

        # the failed rank's peer never comes to the block (blocked elsewhere): the failed rank raises alone
        ranks.FAILED_RANK_WAIT = 1.0
        if rank == 0:
            start = time.monotonic()
            results["alone"] = _outcome(fails_on(0, ValueError("alone")))
            results["alone_seconds"] = time.monotonic() - start
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def test_an_exception_on_one_rank_is_raised_on_every_rank(tmp_path):
    run_ranks(HERE, tmp_path, hung="a rank hung: another rank's exception did not reach it")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    # the failing rank raises its own error; the other raises the same type, naming the failing rank
    assert r1["value_error"] == {"type": "ValueError", "text": "probe row 2: bad"}
    assert r0["value_error"] == {"type": "ValueError", "text": "rank 1: probe row 2: bad"}
    assert r0["unbuildable"] == {"type": "Unbuildable", "text": "code 7: lost"}
    assert r1["unbuildable"] == {"type": "RankFailure", "text": "rank 0: Unbuildable: code 7: lost"}
    assert r0["after"] == r1["after"] == {"type": None, "text": None}
    push = "vllm weight reload /pause: cannot reach http://127.0.0.1:9/pause (refused) (at sync 1; " \
           "GRPOConfig.vllm_server_timeout: 0.5 s)"
    assert r0["push"] == {"type": "ServerError", "text": push}
    assert r1["push"] == {"type": "ServerError", "text": f"rank 0: {push}"}
    probe = ("vLLM server http://127.0.0.1:8000 did not answer the sync check's probe (8 sequences) within 0.5 s at "
             "sync 2: is it running? (GRPOConfig.vllm_server_timeout)")
    assert r0["probe"] == {"type": "ServerError", "text": probe}
    assert r1["probe"] == {"type": "ServerError", "text": f"rank 0: {probe}"}
    assert r0["alone"] == {"type": "ValueError", "text": "alone"} and 1.0 <= r0["alone_seconds"] < 10


def test_the_loss_reaches_every_rank_through_the_same_block(monkeypatch):
    """The plug-in's loss runs inside :func:`every_rank_raises`: its error goes through the exchange."""
    pytest.importorskip("trl")
    from offpolicy.integrations.trl import OffPolicyGRPOTrainer, ranks

    seen = []
    monkeypatch.setattr(ranks, "raise_on_any_rank", seen.append)
    OffPolicyGRPOTrainer._compute_loss(object(), None, {})  # no prompt_ids: a KeyError, handed to the exchange
    assert len(seen) == 1 and isinstance(seen[0], KeyError)


@pytest.mark.parametrize("why", ["untested torch", "no getter"])
def test_without_the_private_store_a_failing_rank_raises_alone(monkeypatch, why):
    """The private ``_get_default_store`` is read on the tested torch releases only; elsewhere (or where it is gone)
    the failing rank raises its own error and the others go on: the behaviour without the exchange."""
    import torch
    from torch.distributed import distributed_c10d

    from offpolicy.integrations.trl import ranks

    assert ranks.world_size() == 1
    monkeypatch.setattr(ranks, "world_size", lambda group=None: 2)  # as if two processes
    monkeypatch.setattr(ranks._Blocks, "warned", False)
    if why == "untested torch":
        monkeypatch.setattr(torch, "__version__", "2.99.0")
    else:
        monkeypatch.delattr(distributed_c10d, "_get_default_store")
    assert ranks._default_store() is None
    with pytest.raises(ValueError, match="^mine$"):
        ranks.raise_on_any_rank(ValueError("mine"))
    ranks.raise_on_any_rank(None)  # nothing to wait for: returns


if __name__ == "__main__":
    run_rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    # verdicts written and the group destroyed: leave without the interpreter's teardown, where gloo's worker
    # threads are sometimes still joinable as their C++ objects are destroyed (tests/integrations/test_trl_sync_ranks.py)
    sys.stdout.flush()
    os._exit(0)
