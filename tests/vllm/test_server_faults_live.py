"""A live vLLM server's reloads and faults: a reload from a checkpoint that stores the tied head once leaves vLLM's
CPU backend on the old head (every endpoint answers 200) and the sync check catches it; the trainer on a server
engine stops in one line when the server dies mid-run, keeps its checkpoints, and ``--resume`` continues once a
server is back."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from offpolicy.rollout.sampling import SamplingConfig
from offpolicy.rollout.servers import connect_server, write_reload_checkpoint
from offpolicy.rollout.sync_check import SyncCheck, SyncCheckError, SyncProbe
from offpolicy.rollout.vllm_server import VLLMServer


@pytest.fixture
def model_copy(tmp_path):
    from offpolicy.models import model_path

    folder = tmp_path / "served"
    shutil.copytree(model_path("tiny"), folder)
    return folder


def _check_sync_cli(model_dir, url):
    from typer.testing import CliRunner

    from offpolicy.cli import app

    # an fp32 server against the fp32 trainer: round-off is ~1e-6, so 1e-3 nats per token already means other weights
    return CliRunner().invoke(app, ["inspect", "--model", str(model_dir), "--rollout", f"server={url}",
                                    "--check-sync", "1e-3"])


def test_a_reload_that_leaves_the_tied_head_behind_is_caught(model_copy, vllm_cache, tmp_path):
    from offpolicy.models import load_model

    model, tok = load_model("tiny")
    with VLLMServer(model_copy, dtype="float32", cache_dir=vllm_cache) as server:
        engine = connect_server(server.url, vocab_size=model.config.vocab_size, tokenizer=tok)
        prompts = [tok(f"{a}+{b}=")["input_ids"] for a, b in [(3, 4), (12, 30), (77, 7), (5, 50)]]
        out = engine.generate(prompts, SamplingConfig(max_new_tokens=6), seed=0)
        check = SyncCheck()
        assert check.calibrate(engine, model, SyncProbe.from_rollout(out.prompt_ids, out.completion_ids))[
            "sync/baseline"] < 1e-5  # fp32 against fp32
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen), alpha=0.02)
        model.save_pretrained(model_copy)  # the usual checkpoint: the tied head stored once, as the embedding
        engine.reload_weights(str(model_copy))  # pause, reload_weights, reset_prefix_cache, resume: all 200
        with pytest.raises(SyncCheckError, match="reload from save_pretrained"):
            check.after_sync(engine, model, what="reload from save_pretrained")
        trainer_dir = tmp_path / "trainer"  # the trainer's side of `offpolicy inspect --check-sync`: the new weights
        model.save_pretrained(trainer_dir)
        tok.save_pretrained(trainer_dir)
        res = _check_sync_cli(trainer_dir, server.url)
        assert res.exit_code != 0 and "hold different models" in res.output, res.output
        write_reload_checkpoint(model, model_copy)  # every tensor under its own name, lm_head.weight included
        engine.reload_weights(str(model_copy))
        assert check.after_sync(engine, model, what="reload with the head")["sync/ok"] == 1.0
        res = _check_sync_cli(trainer_dir, server.url)
        assert res.exit_code == 0 and "sync OK" in res.output, res.output


def _train(out, url, weights_dir, *extra):
    args = ["train", "model.path=tiny", "task.prompts_per_step=4", "algorithm.group_size=4", "algorithm.preset=tis",
            "rollout.engine=server", f"rollout.server.url={url}", f"rollout.server.weights_dir={weights_dir}",
            "rollout.server.timeout=30", "rollout.sampling.max_new_tokens=6", "optim.lr=1e-3", f"run.out_dir={out}",
            "run.steps=8", "run.checkpoint_every=1", "run.threads=1", *extra]
    return subprocess.Popen([sys.executable, "-c", "from offpolicy.cli import main; main()", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _metrics(out):
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _running_in_group(pgid: int, wait: float = 10.0) -> list[int]:
    """Processes of group ``pgid`` that are still running (not zombies) after up to ``wait`` seconds."""
    deadline = time.monotonic() + wait
    while True:
        running = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                running.append(int(stat.parent.name))
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.2)


def test_a_server_killed_mid_run_stops_it_in_one_line_and_resume_continues(model_copy, vllm_cache, tmp_path):
    out = tmp_path / "run"
    server = VLLMServer(model_copy, dtype="float32", cache_dir=vllm_cache)
    assert server.process is not None
    group = server.process.pid  # the server leads a process group of its own (its engine core, its workers)
    try:
        proc = _train(out, server.url, model_copy)

        def kill_after_two_steps():
            while proc.poll() is None and len(_metrics(out)) < 2:
                time.sleep(0.02)
            server.kill()

        watcher = threading.Thread(target=kill_after_two_steps)
        watcher.start()
        output, _ = proc.communicate(timeout=600)
        watcher.join()
    finally:
        server.close()
    assert _running_in_group(group) == [], "the killed server left engine processes running"
    done = len(_metrics(out))
    assert proc.returncode != 0 and 2 <= done < 8, output
    last = [line for line in output.splitlines() if line.strip()][-1]
    assert "vllm" in last and server.url in last, last  # one line naming the engine and the request
    checkpoints = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert checkpoints[-1] == f"step_{done:08d}.safetensors"  # every completed step saved, nothing half-written

    with VLLMServer(model_copy, dtype="float32", cache_dir=vllm_cache) as again:  # back, on another port
        proc = _train(out, again.url, model_copy, "--resume")
        output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output
    metrics = _metrics(out)
    assert len(metrics) == 8 and all(m["sync/ok"] == 1.0 for m in metrics if "sync/ok" in m)
