"""The plug-in's engine across two processes, as on a cluster: gloo, FSDP2 sharding the tiny Qwen2 over both ranks.

Three processes run the same step — one alone (world size 1, the whole batch), two together (world size 2, rows 0–3
on rank 0 and 4–7 on rank 1, each rank's share as verl's dispatch hands it) — with the plug-in on (DVP min-p 0.3, ALP
σ₀ = 0.05, lr 0.1): the old-log-prob forward, then one ``train_mini_batch``. ALP's noise is drawn from a generator
reseeded from each micro-batch's token ids, so both layouts perturb the same rows with the same noise. Then the
two-process run must equal the one-process run: log-probs (the sharded engine's recipe forward), the full gradient
of every weight (FSDP2's reduce-scatter) and log σ's gradient and new value (the plug-in's all-reduce over the
data-parallel group; without it each rank would step σ with half the batch's gradient).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

pytest.importorskip("verl")

from offpolicy_testkit.verl_cpu import ActorBatch, make_worker, process_group, setup_cpu_verl, tiny_qwen2

from offpolicy.rollout.processes import free_port

HERE = pathlib.Path(__file__).resolve()
SETTINGS = {"sampling": {"min_p": 0.3}, "alp": {"init_std": 0.05, "lr": 0.1, "seed": 0}}


SHAPE = ActorBatch()  # the verl tests' batch (offpolicy_testkit/verl_cpu.py)


def run_rank(rank: int, world: int, port: int, model_path: str, out: str) -> None:
    """One process's share of the step; writes its results to ``out/rank{rank}_of_{world}.pt``."""
    setup_cpu_verl()
    with process_group(rank, world, port):
        w = make_worker(model_path, SETTINGS)
        engine = w.engine
        forward_step = engine.forward_step

        def seeded_forward_step(micro_batch, loss_function, forward_only):
            engine.alp.reseed(int(micro_batch["input_ids"].values().sum()))  # the same rows → the same noise
            return forward_step(micro_batch, loss_function, forward_only)

        engine.forward_step = seeded_forward_step
        sigma_grads = []
        optimizer_step = engine.optimizer.step

        def record_sigma_grad_then_step(*args, **kwargs):  # after the plug-in's all-reduce, as the optimiser sees it
            sigma_grads.append(engine.alp.log_sigma.grad.detach().clone())
            return optimizer_step(*args, **kwargs)

        engine.optimizer.step = record_sigma_grad_then_step
        share = SHAPE.b // world
        rows = slice(rank * share, (rank + 1) * share)
        logp = SHAPE.infer_logp(w, rows=rows)
        old = logp + 0.1 * torch.randn(SHAPE.b, SHAPE.r, generator=torch.Generator().manual_seed(3))[rows]
        tensors = {"old_log_probs": old, "advantages": SHAPE.advantages[rows, None].expand(share, SHAPE.r).contiguous()}
        _, grad = SHAPE.train(w, "vanilla", "token-mean", tensors, rows=rows)
        torch.save({"logp": logp, "grad": grad, "sigma_grad": sigma_grads[0],
                    "log_sigma": engine.alp.log_sigma.detach().clone(),
                    "dp": engine.get_data_parallel_size()},
                   os.path.join(out, f"rank{rank}_of_{world}.pt"))


def test_two_processes_equal_one(tmp_path):
    model_path = tiny_qwen2(tmp_path / "model")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    runs = [(0, 1, free_port()), *((rank, 2, port) for port in [free_port()] for rank in (0, 1))]
    procs = [subprocess.Popen([sys.executable, str(HERE), str(rank), str(world), str(port), model_path,
                               str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for rank, world, port in runs]
    for p in procs:
        output = p.communicate(timeout=300)[0].decode(errors="replace")
        assert p.returncode == 0, output[-3000:]
    one = torch.load(tmp_path / "rank0_of_1.pt")
    two = [torch.load(tmp_path / f"rank{r}_of_2.pt") for r in (0, 1)]
    assert one["dp"] == 1 and two[0]["dp"] == two[1]["dp"] == 2

    torch.testing.assert_close(torch.cat([two[0]["logp"], two[1]["logp"]]), one["logp"], rtol=1e-5, atol=1e-5)
    for t in two:  # every rank holds the same full gradient and the same σ
        torch.testing.assert_close(t["grad"], one["grad"], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(t["sigma_grad"], one["sigma_grad"], rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(t["log_sigma"], one["log_sigma"], rtol=1e-5, atol=1e-6)
    assert one["sigma_grad"].abs().min() > 0 and one["grad"].abs().max() > 1e-3


if __name__ == "__main__":
    rank_, world_, port_, model_path_, out_ = sys.argv[1:]
    run_rank(int(rank_), int(world_), int(port_), model_path_, out_)
