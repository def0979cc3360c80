"""A live vLLM server's reloads and faults: every sync into a server started on a sharded checkpoint takes (through a
reload folder of the project's own; the model's files stay byte for byte), a checkpoint that stores the tied head
once is refused, and reloaded around the refusal it leaves vLLM's CPU backend on the old head (every endpoint
answers 200), which the sync check names; the trainer on a server
engine stops in one line when the server dies mid-run, keeps its checkpoints, and ``--resume`` continues once a
server is back."""

from __future__ import annotations

import hashlib
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
from offpolicy.rollout.servers import connect_server
from offpolicy.rollout.sync_check import SyncCheck, SyncCheckError, SyncProbe
from offpolicy.rollout.vllm_server import VLLMServer


@pytest.fixture
def model_copy(tmp_path):
    from offpolicy.models import model_path

    folder = tmp_path / "served"
    shutil.copytree(model_path("tiny"), folder)
    return folder


@pytest.fixture
def sharded_copy(tmp_path):
    """The tiny model saved as a sharded checkpoint (an index and several shards, as every model above ~5 GB is)."""
    from offpolicy.models import load_model

    model, tok = load_model("tiny")
    folder = tmp_path / "sharded"
    model.save_pretrained(folder, max_shard_size="2MB")
    tok.save_pretrained(folder)
    assert (folder / "model.safetensors.index.json").exists() and len(list(folder.glob("*.safetensors"))) > 1
    return folder


def _hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _check_sync_cli(model_dir, url):
    from typer.testing import CliRunner

    from offpolicy.cli import app

    # an fp32 server against the fp32 trainer: round-off is ~1e-6, so 1e-3 nats per token already means other weights
    return CliRunner().invoke(app, ["inspect", "--model", str(model_dir), "--rollout", f"server={url}",
                                    "--check-sync", "1e-3"])


def test_every_sync_into_a_sharded_model_takes_and_leaves_its_files_untouched(sharded_copy, vllm_cache, tmp_path):
    from offpolicy.models import load_model
    from offpolicy.rollout.protocols import vllm_reload_weights

    model, tok = load_model("tiny")
    before = _hashes(sharded_copy)
    with VLLMServer(sharded_copy, dtype="float32", cache_dir=vllm_cache) as server:
        engine = connect_server(server.url, vocab_size=model.config.vocab_size, tokenizer=tok,
                                weights_dir=tmp_path / "reload")
        prompts = [tok(f"{a}+{b}=")["input_ids"] for a, b in [(3, 4), (12, 30), (77, 7), (5, 50)]]
        out = engine.generate(prompts, SamplingConfig(max_new_tokens=6), seed=0)
        check = SyncCheck()
        assert check.calibrate(engine, model, SyncProbe.from_rollout(out.prompt_ids, out.completion_ids))[
            "sync/baseline"] < 1e-5  # fp32 against fp32
        gen = torch.Generator().manual_seed(0)
        for step in range(3):  # every sync through the reload folder takes: the gap stays at round-off
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=gen), alpha=0.02)
            engine.sync_weights(model)
            metrics = check.after_sync(engine, model, what=f"sync {step + 1}")
            assert metrics["sync/ok"] == 1.0 and metrics["sync/gap"] < 1e-5, metrics
        assert _hashes(sharded_copy) == before  # the served model's own files: byte for byte as they were

        # the usual checkpoint stores the tied head once: refused before any request ...
        saved = tmp_path / "saved"
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen), alpha=0.02)
        model.save_pretrained(saved)
        with pytest.raises(ValueError, match="head is stored once"):
            engine.reload_weights(str(saved))
        # ... and a reload of it that goes around the refusal answers 200 and leaves the old head: the check names it
        vllm_reload_weights(server.url, str(saved), timeout=60, weights_path=str(saved))
        with pytest.raises(SyncCheckError, match="reload from save_pretrained"):
            check.after_sync(engine, model, what="reload from save_pretrained")
        trainer_dir = tmp_path / "trainer"  # the trainer's side of `offpolicy inspect --check-sync`: the new weights
        model.save_pretrained(trainer_dir)
        tok.save_pretrained(trainer_dir)
        res = _check_sync_cli(trainer_dir, server.url)
        assert res.exit_code != 0 and "hold different models" in res.output, res.output
        engine.sync_weights(model)  # every tensor under its own name, lm_head.weight included
        res = _check_sync_cli(trainer_dir, server.url)
        assert res.exit_code == 0 and "sync OK" in res.output, res.output


def _train(out, url, *extra):
    args = ["train", "model.path=tiny", "task.prompts_per_step=4", "algorithm.group_size=4", "algorithm.preset=tis",
            "rollout.engine=server", f"rollout.server.url={url}",
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
        proc = _train(out, server.url)

        killed: list[float] = []

        def kill_after_two_steps():
            while proc.poll() is None and len(_metrics(out)) < 2:
                time.sleep(0.02)
            server.kill()
            killed.append(time.monotonic())

        watcher = threading.Thread(target=kill_after_two_steps)
        watcher.start()
        output, _ = proc.communicate(timeout=600)
        stopped = time.monotonic() - killed[0] if killed else None
        watcher.join()
    finally:
        server.close()
    assert _running_in_group(group) == [], "the killed server left engine processes running"
    done = len(_metrics(out))
    assert proc.returncode != 0 and 2 <= done < 8, output
    last = [line for line in output.splitlines() if line.strip()][-1]
    assert "vllm" in last and server.url in last, last  # one line naming the engine and the request
    assert "at sync" in last and "rollout.server.timeout: 30 s" in last, last  # ... the sync, the timeout's setting
    print(f"kill-to-stop: {stopped:.1f} s")
    assert stopped is not None and stopped < 30 + 30, stopped  # within rollout.server.timeout (+ the exit's slack)
    checkpoints = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert checkpoints[-1] == f"step_{done:08d}.safetensors"  # every completed step saved, nothing half-written

    with VLLMServer(model_copy, dtype="float32", cache_dir=vllm_cache) as again:  # back, on another port
        proc = _train(out, again.url, "--resume")
        output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output
    metrics = _metrics(out)
    assert len(metrics) == 8 and all(m["sync/ok"] == 1.0 for m in metrics if "sync/ok" in m)
