"""Each method's cost inside verl's actor update: verl 0.9.1's ``TrainingWorker`` (FSDP2 engine, one CPU process,
gloo) with its own engine and ``vanilla`` policy loss, against the plug-in's engine with each method, the arms
alternating in one process.

    PYTHONPATH=. python benchmarks/verl_overhead.py [--repeat 5] [--steps 3] [--only dvp alp] [--json FILE]

Every arm runs ``train_mini_batch`` (verl's update: micro-batches, forward, ``ppo_loss``, backward, optimiser step)
on the same batch — ``--batch`` sequences of ``--prompt`` + ``--response`` tokens, micro-batches of ``--micro`` — of a
random Qwen2 (hidden ``--hidden``, ``--layers`` layers, vocabulary ``--vocab``, fp32) built once, through the CPU
harness of the verl tests, offpolicy_testkit/verl_cpu.py (a ``cpu`` platform, the engine registered for it, eager
attention, no remove-padding). Arms:

* ``vanilla``          verl's own engine, ``loss_mode: vanilla`` (the baseline)
* ``plugin``           the plug-in's engine with nothing switched on, ``vanilla`` (what naming the plug-in costs)
* ``ipo`` / ``m2po``   the plug-in's engine handing μ to its ``offpolicy_ipo`` / ``offpolicy_m2po`` policy losses
* ``dvp``              ``sampling: {min_p: 1e-3}`` — DVP's log-prob in both forwards of the update
* ``replay``           ``sampling: {top_k: 50, top_p: 0.95}`` — sampling replay
* ``score_centering``  ``topk_logprobs: 8, score_centering: true`` with the batch carrying the engine's top-8
* ``alp``              ``alp: {init_std: 1e-4}`` — noise in the update forward

The token corrections (TIS, IcePop, OPSM, veto, TRM's mask) run in verl's driver after the advantages, on [B, T]
tensors, not in the actor update: they cost nothing here. The top-K TRM bound runs in the old-log-prob forward
(``infer_batch``), which this script does not time.

Seconds per update are the process CPU time (``process_time``, one torch thread) of one ``train_mini_batch``, the
mean of ``--steps`` calls after a warm-up call; one repeat runs every arm once, in an order rotated by one each
repeat; the ratio is an arm's seconds over vanilla's in the same repeat, median and range over repeats.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

ARMS = {
    "vanilla": (None, "vanilla"),
    "plugin": ({}, "vanilla"),
    "ipo": ({}, "offpolicy_ipo"),
    "m2po": ({}, "offpolicy_m2po"),
    "dvp": ({"sampling": {"min_p": 1e-3}}, "vanilla"),
    "replay": ({"sampling": {"top_k": 50, "top_p": 0.95}}, "vanilla"),
    "score_centering": ({"topk_logprobs": 8, "score_centering": True}, "vanilla"),
    "alp": ({"alp": {"init_std": 1e-4}}, "vanilla"),
}
GOALS = {"plugin": 1.03, "ipo": 1.03, "m2po": 1.03, "dvp": 1.10, "replay": 1.30, "score_centering": 1.15, "alp": 1.10}
TOPK = 8


def _model(path: str, vocab: int, hidden: int, layers: int) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def _topk(h, vocab: int):  # h: the ActorBatch
    """The engine's top-K for every response position [B, R, K]: distinct ids, log-probs holding ~90 % of the mass."""
    g = torch.Generator().manual_seed(5)
    ids = torch.rand(h.b, h.r, vocab, generator=g).topk(TOPK, -1).indices
    lp = (torch.softmax(torch.linspace(3.0, 0.0, TOPK), 0) * 0.9).log().expand(h.b, h.r, TOPK).contiguous()
    return lp, ids


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4099)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", nargs="*", default=None, help=f"arms besides vanilla, among {', '.join(ARMS)}")
    ap.add_argument("--json", default=None, help="also write the runs and the table here")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from offpolicy_testkit.verl_cpu import ActorBatch, make_worker, process_group, setup_cpu_verl

    h = ActorBatch(b=a.batch, p=a.prompt, r=a.response, vocab=a.vocab, micro=a.micro,
                   lengths=torch.full((a.batch,), a.response),
                   advantages=torch.randn(a.batch, generator=torch.Generator().manual_seed(2)))
    arms = ["vanilla"] + [x for x in (a.only or ARMS) if x != "vanilla"]
    setup_cpu_verl()
    from offpolicy.integrations.verl.topk import TOPK_IDS_FIELD, TOPK_LOGP_FIELD, sequence_topk

    lp, ids = _topk(h, a.vocab)

    def with_topk(data):
        prompt_lengths = h.inputs()[1][:, :a.prompt].sum(-1).tolist()  # the harness left-pads one prompt
        per_sample = [sequence_topk(int(n), ids[i].tolist(), lp[i].tolist(), TOPK) for i, n in enumerate(prompt_lengths)]
        data[TOPK_LOGP_FIELD] = torch.nested.as_nested_tensor([s[0] for s in per_sample], layout=torch.jagged)
        data[TOPK_IDS_FIELD] = torch.nested.as_nested_tensor([s[1] for s in per_sample], layout=torch.jagged)
        return data

    runs: dict[str, list[float]] = {arm: [] for arm in arms}
    loads: list[float] = []
    with tempfile.TemporaryDirectory() as folder, process_group():
        path = _model(str(Path(folder) / "model"), a.vocab, a.hidden, a.layers)
        workers = {arm: make_worker(path, ARMS[arm][0], micro=a.micro) for arm in arms}
        old = h.infer_logp(workers["vanilla"])
        mu = (old + 0.1 * torch.randn(old.shape, generator=torch.Generator().manual_seed(3))) * h.inputs()[1][:, a.prompt:]
        tensors = {"old_log_probs": old, "advantages": h.advantages[:, None].expand(a.batch, a.response).contiguous(),
                   "rollout_log_probs": mu}
        n_tokens = a.batch * a.response
        print(f"random Qwen2 (V={a.vocab}, H={a.hidden}, {a.layers} layers), {a.batch} × ({a.prompt} + {a.response}) "
              f"tokens per update ({n_tokens} response tokens), micro-batches of {a.micro}, {a.threads} thread(s)")

        def update(arm: str) -> None:
            prepare = with_topk if arm == "score_centering" else None
            h.train(workers[arm], ARMS[arm][1], "token-mean", tensors, prepare=prepare)

        for arm in arms:
            update(arm)  # warm-up
        for rep in range(a.repeat):
            order = arms[rep % len(arms):] + arms[:rep % len(arms)]
            for arm in order:
                loads.append(os.getloadavg()[0])
                c0 = time.process_time()
                for _ in range(a.steps):
                    update(arm)
                runs[arm].append((time.process_time() - c0) / a.steps)
                print(f"repeat {rep + 1} {arm:16s} {runs[arm][-1]:.3f} CPU s per update, load {loads[-1]:.1f}",
                      flush=True)
    table: dict[str, dict[str, float]] = {}
    print(f"\nCPU seconds per update, median over {a.repeat} repeats; ratio to vanilla in the same repeat (median, "
          f"range); load average {min(loads):.1f}–{max(loads):.1f}")
    for arm in arms:
        ratios = [x / b for x, b in zip(runs[arm], runs["vanilla"])]
        row = {"s": statistics.median(runs[arm]), "ratio": statistics.median(ratios), "low": min(ratios),
               "high": max(ratios)}
        table[arm] = row
        goal = GOALS.get(arm)
        verdict = "" if goal is None else f"≤ {goal:.2f}× {'met' if row['ratio'] <= goal else 'MISSED'}"
        print(f"{arm:16s} {row['s']:7.3f} s   {row['ratio']:5.3f}× {row['low']:5.3f}–{row['high']:5.3f}×  {verdict}")
    if a.json:
        from offpolicy_testkit.bench_record import write_record

        write_record(a.json, a, loads, runs, table)
    return table


if __name__ == "__main__":
    main()
