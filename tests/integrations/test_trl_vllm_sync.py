"""offpolicy.integrations.trl.vllm_sync without a live engine: what the push sends (the tied head under its own name),
the sync check around it (calibration, a failed sync named by step, the deferred calibration), the server-mode choice
between TRL's NCCL transfer and files, and the file sync's checkpoint and calls. The live runs are in
tests/vllm/test_trl_live.py."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from offpolicy.integrations.trl.patches import check_server_sync, server_sync_choice
from offpolicy.integrations.trl.vllm_sync import (
    FileSync,
    TRLSyncCheck,
    check_sync_setting,
    default_probe,
    trl_named_weights,
    uses_files,
)
from offpolicy.models.tiny import build_tiny_model
from offpolicy.rollout.sync_check import SyncCheck, SyncCheckError


def _generation(model, mode="colocate"):
    """TRL's ``VLLMGeneration`` as far as the sync reads it: the model, its parameter stream, the mode."""
    return SimpleNamespace(model=model, mode=mode, accelerator=SimpleNamespace(is_main_process=True),
                           _iter_named_params=lambda: iter(list(model.named_parameters())))


def test_the_stream_names_the_tied_head_too():
    # named_parameters() yields the tied head once, as the embedding; the stream adds lm_head.weight right after it,
    # so every state-dict tensor reaches vLLM under its own name
    model, _ = build_tiny_model(seed=0)
    assert "lm_head.weight" not in dict(model.named_parameters())
    names = [n for n, _ in trl_named_weights(_generation(model))]
    assert set(names) == set(model.state_dict()) and len(names) == len(set(names))
    assert names[names.index("model.embed_tokens.weight") + 1] == "lm_head.weight"


class _Engine:
    """An engine that scores with its own copy of the model (fp32: the same numbers as the trainer)."""

    def __init__(self, model):
        self.model = build_tiny_model(seed=0)[0]
        self.model.load_state_dict(model.state_dict())

    def score(self, prompt_ids, completion_ids):
        from offpolicy.rollout.scoring import sequence_logprobs

        with torch.no_grad():
            return sequence_logprobs(self.model, prompt_ids, completion_ids)


def _perturb(model, scale=0.05, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g), alpha=scale)


def _hook(model, engine, check, push):
    logged = []
    hook = TRLSyncCheck(_generation(model), model, check, push=push, step=lambda: 7, log=logged.append,
                        tokenizer=build_tiny_model(seed=0)[1])
    hook.scorer = engine
    return hook, logged


def test_a_sync_that_takes_passes_and_one_that_does_not_is_named():
    model, _ = build_tiny_model(seed=0)
    engine = _Engine(model)
    hook, logged = _hook(model, engine, SyncCheck(), push=lambda: engine.model.load_state_dict(model.state_dict()))
    hook()  # calibrated before the first push (both hold the same weights), then checked after it
    assert logged[-1]["sync/ok"] == 1.0 and logged[-1]["sync/gap"] < 1e-6 and "sync/push_seconds" in logged[-1]
    _perturb(model)
    hook()
    assert logged[-1]["sync/ok"] == 1.0
    # a push that leaves the last decoder layer behind
    _perturb(model, seed=2)
    stale = {k: v for k, v in model.state_dict().items() if ".layers.3." not in k}
    hook.push = lambda: engine.model.load_state_dict(stale, strict=False)
    with pytest.raises(SyncCheckError, match="vLLM weight sync at step 7"):
        hook()


def test_warn_logs_and_reports_sync_ok_zero(caplog):
    model, _ = build_tiny_model(seed=0)
    engine = _Engine(model)
    hook, logged = _hook(model, engine, check_sync_setting("warn"), push=lambda: None)  # a push that does nothing
    hook()
    _perturb(model)
    with caplog.at_level(logging.WARNING):
        hook()
    assert logged[-1]["sync/ok"] == 0.0 and "did not take" in caplog.text


def test_a_model_that_is_not_the_engines_checkpoint_calibrates_after_the_first_push(caplog):
    model, _ = build_tiny_model(seed=0)
    engine = _Engine(model)
    _perturb(model, scale=0.5)  # the trainer's model changed after the engine loaded the checkpoint
    hook, logged = _hook(model, engine, SyncCheck(), push=lambda: engine.model.load_state_dict(model.state_dict()))
    with caplog.at_level(logging.WARNING):
        hook()
    assert "calibrates right after the first sync" in caplog.text
    assert logged[-1]["sync/baseline"] < 1e-6  # measured after the push
    # a first push that does not take cannot be calibrated either: the two sides hold different models
    hook2, _ = _hook(model, _Engine(build_tiny_model(seed=0)[0]), SyncCheck(), push=lambda: None)
    with pytest.raises(SyncCheckError, match="different models"):
        hook2()


def test_settings_are_checked():
    assert check_sync_setting(None) is None and check_sync_setting(False) is None
    own = SyncCheck(z=8.0)
    assert check_sync_setting(own) is own and check_sync_setting("error").on_failure == "error"
    with pytest.raises(ValueError, match="sync_check must be one of"):
        check_sync_setting("raise")
    with pytest.raises(ValueError, match="vllm_server_sync must be one of"):
        check_server_sync("http")
    with pytest.raises(ValueError, match="tokenizer"):
        default_probe(None)


def test_server_mode_skips_trls_nccl_group_off_cuda_and_restores_it():
    vc = pytest.importorskip("trl.generation.vllm_client")
    original = vc.VLLMClient.init_communicator
    server = SimpleNamespace(use_vllm=True, vllm_mode="server")
    client = SimpleNamespace()
    with server_sync_choice(server, "auto"):
        vc.VLLMClient.init_communicator(client, device="cpu")  # what TRL's __init__ calls on a CPU trainer
    assert vc.VLLMClient.init_communicator is original
    assert client.communicator is None and uses_files(SimpleNamespace(vllm_client=client))
    forced = SimpleNamespace()
    with server_sync_choice(server, "files"):
        vc.VLLMClient.init_communicator(forced, device=0)  # even on a CUDA index: files
    assert uses_files(SimpleNamespace(vllm_client=forced))
    with server_sync_choice(server, "nccl"):
        assert vc.VLLMClient.init_communicator is original  # TRL's own group, untouched
    with server_sync_choice(SimpleNamespace(use_vllm=True, vllm_mode="colocate"), "auto"):
        assert vc.VLLMClient.init_communicator is original


def test_the_file_sync_writes_every_tensor_and_calls_the_dev_endpoints(tmp_path, monkeypatch):
    import importlib

    from safetensors.torch import load_file

    from offpolicy.rollout.protocols import vllm_reload_weights

    calls = []
    home = importlib.import_module(vllm_reload_weights.__module__)  # where the reload looks post_json up
    monkeypatch.setattr(home, "post_json", lambda url, body, **kw: calls.append((url, body)) or {})
    model, _ = build_tiny_model(seed=0)
    generation = _generation(model, mode="server")
    generation.vllm_client = SimpleNamespace(base_url="http://127.0.0.1:9")
    FileSync(generation, tmp_path)()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    saved = {}
    for shard in set(index.values()):
        saved.update(load_file(str(tmp_path / shard)))
    assert set(saved) == set(model.state_dict())  # the tied head under its own name too
    torch.testing.assert_close(saved["lm_head.weight"], model.state_dict()["lm_head.weight"])
    assert [c[0].rsplit("/", 1)[1] for c in calls] == ["pause", "collective_rpc", "collective_rpc",
                                                       "reset_prefix_cache", "resume"]
    assert calls[1][1] == {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path)}}


# -- GPU branches, by stub: TRL's own push on a CUDA vLLM, TRL's NCCL group on a CUDA device ---------------------------
def _trainer(generation, model):
    return SimpleNamespace(vllm_generation=generation, model=model, state=SimpleNamespace(global_step=0),
                           _metrics={"train": {}, "eval": {}}, processing_class=build_tiny_model(seed=0)[1])


@pytest.mark.parametrize("cpu", [False, True])
def test_colocate_keeps_trls_own_push_on_a_gpu_and_reloads_on_the_cpu_backend(monkeypatch, cpu):
    import offpolicy.integrations.trl.vllm_sync as vs

    monkeypatch.setattr(vs, "vllm_on_cpu", lambda: cpu)
    pushed = []
    monkeypatch.setattr(vs, "colocate_sync", lambda generation: pushed.append("colocate_sync"))
    model, _ = build_tiny_model(seed=0)
    generation = _generation(model)
    generation.sync_weights = lambda: pushed.append("trl")
    hook = vs.install_vllm_sync(_trainer(generation, model), None)
    hook()
    assert pushed == (["colocate_sync"] if cpu else ["trl"])


def test_server_mode_opens_trls_nccl_group_on_a_cuda_device():
    vc = pytest.importorskip("trl.generation.vllm_client")
    original = vc.VLLMClient.init_communicator
    opened = []
    vc.VLLMClient.init_communicator = lambda self, device=0: opened.append(device)  # TRL's, as a stub
    try:
        with server_sync_choice(SimpleNamespace(use_vllm=True, vllm_mode="server"), "auto"):
            client = SimpleNamespace()
            vc.VLLMClient.init_communicator(client, device=0)  # a CUDA index: TRL's own group
            vc.VLLMClient.init_communicator(client, device="cuda:1")
        assert opened == [0, "cuda:1"] and not uses_files(SimpleNamespace(vllm_client=client))
    finally:
        vc.VLLMClient.init_communicator = original


# -- several ranks: every rank runs the probe's trainer forward as often as the main one -------------------------------
class _CountingModel(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.inner, self.calls = model, 0
        self.config = model.config

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


@pytest.mark.parametrize("deferred", [False, True])
def test_every_rank_joins_the_probes_forward_in_server_mode(deferred):
    model, tok = build_tiny_model(seed=0)
    engine = _Engine(model)
    if deferred:
        _perturb(model, scale=0.5)  # the main rank calibrates after the first push
    counted = {}
    for main in (True, False):
        m = _CountingModel(model)
        generation = _generation(m, mode="server")
        generation.accelerator = SimpleNamespace(is_main_process=main)
        hook = TRLSyncCheck(generation, m, SyncCheck(on_failure="warn"), tokenizer=tok, step=lambda: 1,
                            log=lambda metrics: None,
                            push=lambda: engine.model.load_state_dict(model.state_dict()))
        hook.scorer = engine
        hook()
        hook()
        counted[main] = m.calls
    assert counted[True] == counted[False] == 3  # calibration before the first push + one after each push
