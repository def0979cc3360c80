"""The sync check's parameter layer on a transformers engine that stores its tensors as vLLM does (q, k, v fused into
one ``qkv_proj``; the engine's dtype): healthy syncs at any learning rate pass, including steps below bf16's
resolution; a decoder layer or an untied head left behind is named at the first sync, where the behavioural layer
cannot resolve it; tensors the layer cannot read or map are counted, not checked."""

from __future__ import annotations

import copy

import pytest
import torch

from offpolicy.rollout import param_check
from offpolicy.rollout.hf import HFRolloutEngine
from offpolicy.rollout.param_check import ParameterCheck, device_digest, fingerprint, trainer_sources
from offpolicy.rollout.sampling import SamplingConfig
from offpolicy.rollout.sync_check import SyncCheck, SyncProbe

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}


class FusedEngine(HFRolloutEngine):
    """The transformers engine exposing its tensors in vLLM's layout; its sync can leave a part behind."""

    def __init__(self, *args, leave: str | None = None, **kwargs):
        self.leave = None  # the constructor's own first sync loads everything
        super().__init__(*args, **kwargs)
        self.leave = leave

    def sync_weights(self, model):
        kept = {k: v.detach().clone() for k, v in self.model.state_dict().items()
                if self.leave is not None and k.startswith(self.leave)}
        super().sync_weights(model)
        if self.leave == "lm_head":  # untie and keep the old head, as vLLM's CPU backend does on a reload from files
            self.model.lm_head.weight = torch.nn.Parameter(kept["lm_head.weight"])
        else:
            with torch.no_grad():
                for name, value in kept.items():
                    self.model.get_parameter(name).copy_(value)

    def engine_parameters(self):
        def tensors():
            groups: dict[str, list[torch.Tensor]] = {}
            for name, p in self.model.named_parameters(remove_duplicate=False):
                for src in PACKED["qkv_proj"]:
                    if f".{src}." in name:
                        groups.setdefault(name.replace(src, "qkv_proj"), []).append(p)
                        break
                else:
                    yield name, p
            for name, parts in groups.items():
                yield name, torch.cat(parts)
            yield "model.rotary_emb.inv_freq", torch.ones(4)  # no trainer source: not checked
            yield "model.layers.0.mlp.packed_elsewhere", torch.empty(0)  # repacked out of reach: not checked

        return tensors(), PACKED


def _adam_like_step(model, lr, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randint(0, 2, p.shape, generator=gen).float() * 2 - 1, alpha=lr)


@pytest.fixture
def rig():
    from offpolicy.models import load_model

    base, tok = load_model("tiny")

    def build(leave: str | None, dtype: str = "bfloat16", fingerprints: str = "blake2b"):
        model = copy.deepcopy(base)
        engine = FusedEngine(copy.deepcopy(model), dtype=dtype, tokenizer=tok, leave=leave)
        prompts = [tok(f"{a}+{b}=")["input_ids"] for a, b in [(3, 4), (12, 30), (7, 7), (25, 50)]]
        out = engine.generate(prompts, SamplingConfig(max_new_tokens=8), seed=0)
        check = SyncCheck(on_failure="warn")
        check.calibrate(engine, model, SyncProbe.from_rollout(out.prompt_ids, out.completion_ids))
        if fingerprints == "digest":  # the device digest on these CPU tensors, as it runs on a GPU engine's
            named, packed = engine.engine_parameters()
            check.parameters = ParameterCheck(packed=packed, host_types=())
            check.parameters.calibrate(named, model.state_dict())
        return model, engine, check

    return build


def test_sources_of_fused_and_plain_tensors():
    names = {"a.q_proj.w", "a.k_proj.w", "a.v_proj.w", "a.norm.w"}
    assert trainer_sources("a.qkv_proj.w", PACKED, names) == ["a.q_proj.w", "a.k_proj.w", "a.v_proj.w"]
    assert trainer_sources("a.qkv_proj.w", PACKED, names - {"a.v_proj.w"}) is None  # a source missing: unmapped
    assert trainer_sources("a.norm.w", PACKED, names) == ["a.norm.w"]


def test_fingerprints_see_one_changed_element_dtype_and_shape():
    x = torch.randn(64, dtype=torch.bfloat16)
    y = x.clone()
    y.view(torch.int16)[17] ^= 1  # the last bit of one element
    assert fingerprint(x) == fingerprint(x.clone()) and fingerprint(x) != fingerprint(y)
    assert fingerprint(x.float()) != fingerprint(x) and fingerprint(x.view(8, 8)) != fingerprint(x)


def _reference_digest(words: list[int], block: int) -> list[int]:
    """The device digest's formula in Python integers: h_k = Σ_b s_kb (Σ_j r_kj w_bj mod P) mod P."""
    p, hashes = param_check.DIGEST_P, []
    for k in range(param_check.DIGEST_K):
        rows = param_check._coefficient(torch.device("cpu"), 0)[k].tolist()
        h = 0
        for b in range(0, -(-len(words) // block)):
            segment, offset = divmod(b, block)
            s_b = int(param_check._coefficient(torch.device("cpu"), 1 + segment)[k, offset])
            inner = sum(r * w for r, w in zip(rows, words[b * block:(b + 1) * block])) % p
            h = (h + s_b * inner) % p
        hashes.append(h)
    return hashes


def _digest_values(digest: bytes) -> list[int]:
    tail = digest[-4 * param_check.DIGEST_K:]
    return [int.from_bytes(tail[4 * k:4 * k + 4], "little") for k in range(param_check.DIGEST_K)]


def test_the_device_digest_is_its_formula_without_overflow():
    # one block of 2¹⁶ words, each 0xFFFF (the largest word): Σ_j r_j w_j reaches ≈ 2⁶³ before its reduction — the
    # int64 sum must equal the exact integer one
    x = torch.full((param_check.BLOCK,), -1, dtype=torch.int16).view(torch.bfloat16)
    assert _digest_values(device_digest(x)) == _reference_digest([0xFFFF] * param_check.BLOCK, param_check.BLOCK)


def test_the_device_digest_spans_chunks_and_coefficient_segments(monkeypatch):
    # blocks of 16 words, passes of 64: 3 segments of 16 blocks each, so every index computation is exercised
    monkeypatch.setattr(param_check, "BLOCK", 16)
    monkeypatch.setattr(param_check, "CHUNK", 64)
    monkeypatch.setattr(param_check, "_coefficients", {})
    x = torch.randn(16 * 16 * 2 + 40)  # float32: two words per element, the last block partial
    words = (x.view(torch.int16).to(torch.int64) & 0xFFFF).tolist()
    assert _digest_values(device_digest(x)) == _reference_digest(words, 16)
    swapped = x.view(-1, 8).clone()  # two blocks (8 elements = 16 words each) trade places: another digest
    swapped[[3, 20]] = swapped[[20, 3]]
    late = x.clone()
    late.view(torch.int16)[-1] ^= 1  # the last word, in the third segment
    digests = {device_digest(x), device_digest(swapped.view(-1)), device_digest(late), device_digest(x[:-1])}
    assert len(digests) == 4


def test_the_device_digest_sees_one_changed_word_dtype_and_shape():
    x = torch.randn(3 * param_check.CHUNK // 2 + 7, dtype=torch.bfloat16)  # more than one pass
    for position in (0, param_check.BLOCK - 1, x.numel() - 1):
        y = x.clone()
        y.view(torch.int16)[position] ^= 1
        assert device_digest(y) != device_digest(x)
    assert device_digest(x.view(-1, 1)) != device_digest(x) and device_digest(x.half()) != device_digest(x)
    assert device_digest(x.float(), torch.bfloat16) == device_digest(x)  # cast chunk by chunk: the same bytes
    with pytest.raises(ValueError, match="dtype torch.int8"):
        device_digest(torch.zeros(4, dtype=torch.int8))


def _two_sides():
    # the engine: one fused qkv tensor and a norm in bf16; the trainer: q, k, v and the norm in float32
    trainer = {f"l.{n}_proj.w": torch.randn(64, 32) for n in "qkv"} | {"l.norm.w": torch.randn(32)}
    engine = {"l.qkv_proj.w": torch.cat([trainer[f"l.{n}_proj.w"] for n in "qkv"]).bfloat16(),
              "l.norm.w": trainer["l.norm.w"].bfloat16()}
    return engine, trainer


def test_bytes_read_per_sync_in_each_mode():
    engine, trainer = _two_sides()
    engine_bytes = sum(t.numel() * 2 for t in engine.values())  # bf16
    trainer_fp32 = sum(t.numel() * 4 for t in trainer.values())
    # hash: both sides through BLAKE2b on the host, the trainer's sources cast to bf16 first
    hashed = ParameterCheck(packed=PACKED, mode="hash")
    hashed.calibrate(engine.items(), trainer)
    assert (hashed.bytes_hashed, hashed.bytes_digested) == (2 * engine_bytes, 0)
    # device, where the tensors live off the host: nothing hashed or copied; each side read once in its own dtype
    digested = ParameterCheck(packed=PACKED, host_types=())
    digested.calibrate(engine.items(), trainer)
    assert (digested.bytes_hashed, digested.bytes_copied) == (0, 0)
    assert digested.bytes_digested == engine_bytes + trainer_fp32
    # device, on the host: already there, hashed without a copy
    host = ParameterCheck(packed=PACKED)
    host.calibrate(engine.items(), trainer)
    assert (host.bytes_hashed, host.bytes_copied, host.bytes_digested) == (2 * engine_bytes, 0, 0)
    trainer["l.k_proj.w"] = trainer["l.k_proj.w"] + 1.0  # k moved, the engine's qkv did not: named either way
    assert digested.after_sync(engine.items(), trainer) == ["l.qkv_proj.w"] == host.after_sync(engine.items(), trainer)


def test_the_setting_selects_the_mode_and_rejects_another():
    from offpolicy.models import load_model
    from offpolicy.train.config import load_config

    assert SyncCheck().parameter_mode == SyncCheck(parameters="device").parameter_mode == "device"
    assert SyncCheck(parameters="hash").parameter_mode == "hash" and SyncCheck(parameters=False).parameter_mode is None
    with pytest.raises(ValueError, match="parameters must be True, False or one of"):
        SyncCheck(parameters="sha256")
    with pytest.raises(ValueError, match="mode must be one of"):
        ParameterCheck(mode="sha256")
    model, tok = load_model("tiny")
    check = SyncCheck(on_failure="warn", parameters="hash")
    check.calibrate(FusedEngine(copy.deepcopy(model), dtype="bfloat16", tokenizer=tok), model, SyncProbe.from_text(tok))
    assert check.parameters is not None and check.parameters.mode == "hash" and check.parameters.bytes_hashed > 0
    cfg = load_config(None, ["rollout.sync_check_parameters=hash"])
    assert cfg.rollout.sync_check_parameters == "hash"
    with pytest.raises(ValueError, match="rollout.sync_check_parameters"):
        load_config(None, ["rollout.sync_check_parameters=sha256"])


def test_a_step_below_the_engines_resolution_is_no_verdict():
    # the trainer moves by 1e-12 (far below bf16's resolution): its cast and the engine stay as they were
    check = ParameterCheck()
    trainer = {"w": torch.randn(32)}
    engine = {"w": trainer["w"].to(torch.bfloat16)}
    check.calibrate(engine.items(), trainer)
    trainer["w"] = trainer["w"] + 1e-12
    assert check.after_sync(engine.items(), trainer) == []
    trainer["w"] = trainer["w"] + 0.5  # now the cast changes and the engine did not: left behind
    assert check.after_sync(engine.items(), trainer) == ["w"]


def test_a_quantised_engine_tensor_is_counted_not_judged():
    # an int8 pack (or fp8 with a scale) is not a plain cast of its source: it may stay as it is while the source's
    # cast changes, so the layer leaves it to the behavioural tests
    check = ParameterCheck()
    trainer = {"w": torch.zeros(8), "b": torch.zeros(8)}
    engine = {"w": torch.zeros(8, dtype=torch.int8), "b": torch.zeros(8, dtype=torch.bfloat16)}
    check.calibrate(engine.items(), trainer)
    assert (check.checked, check.total) == (1, 2)
    trainer = {"w": torch.full((8,), 3.0), "b": torch.full((8,), 3.0)}
    assert check.after_sync(engine.items(), trainer) == ["b"]


def _moe_sides(layout: str, experts: int = 4, hidden: int = 6, inner: int = 3):
    """One MoE layer: the trainer's experts stacked (transformers >= 5) or one module per expert, in float32; the
    engine's as vLLM 0.32's fused experts store them (``experts.routed_experts.w13_weight`` [E, 2I, H] and
    ``w2_weight`` [E, H, I]) in bf16."""
    gate_up, down = torch.randn(experts, 2 * inner, hidden), torch.randn(experts, hidden, inner)
    if layout == "stacked":
        trainer = {"m.l.0.mlp.experts.gate_up_proj": gate_up, "m.l.0.mlp.experts.down_proj": down}
    else:
        trainer = {}
        for e in range(experts):
            trainer |= {f"m.l.0.mlp.experts.{e}.gate_proj.weight": gate_up[e, :inner],
                        f"m.l.0.mlp.experts.{e}.up_proj.weight": gate_up[e, inner:],
                        f"m.l.0.mlp.experts.{e}.down_proj.weight": down[e]}
    trainer["m.l.0.mlp.gate.weight"] = torch.randn(experts, hidden)  # the router: a plain tensor on both sides
    engine = {"m.l.0.mlp.experts.routed_experts.w13_weight": gate_up.bfloat16(),
              "m.l.0.mlp.experts.routed_experts.w2_weight": down.bfloat16(),
              "m.l.0.mlp.gate.weight": trainer["m.l.0.mlp.gate.weight"].bfloat16()}
    return engine, trainer


@pytest.mark.parametrize("layout", ["stacked", "per_expert"])
def test_vllms_fused_experts_are_checked_against_the_trainers_experts(layout):
    engine, trainer = _moe_sides(layout)
    check = ParameterCheck()
    check.calibrate(engine.items(), trainer)
    assert (check.checked, check.total) == (3, 3)  # both expert tensors and the router
    moved = {k: v + 0.5 for k, v in trainer.items()}
    synced = {"m.l.0.mlp.experts.routed_experts.w13_weight": engine["m.l.0.mlp.experts.routed_experts.w13_weight"] + 0.5,
              "m.l.0.mlp.experts.routed_experts.w2_weight": engine["m.l.0.mlp.experts.routed_experts.w2_weight"],
              "m.l.0.mlp.gate.weight": engine["m.l.0.mlp.gate.weight"] + 0.5}
    # every source moved; the engine took the gate-and-up experts and the router, not the down projections
    assert check.after_sync(synced.items(), moved) == ["m.l.0.mlp.experts.routed_experts.w2_weight"]
    # one expert's down projection moves, the engine's stacked tensor with it: nothing left behind
    if layout == "stacked":
        moved["m.l.0.mlp.experts.down_proj"] = moved["m.l.0.mlp.experts.down_proj"].index_add(
            0, torch.tensor([2]), torch.ones(1, 6, 3))
    else:
        moved["m.l.0.mlp.experts.2.down_proj.weight"] = moved["m.l.0.mlp.experts.2.down_proj.weight"] + 1.0
    synced["m.l.0.mlp.experts.routed_experts.w2_weight"] = synced["m.l.0.mlp.experts.routed_experts.w2_weight"] + 1.0
    assert check.after_sync(synced.items(), moved) == []


def test_an_engine_holding_a_share_of_the_experts_is_counted_not_judged():
    # expert parallelism: the engine's stacked tensor holds 2 of the trainer's 4 experts, so a change in the other
    # two would read as a tensor left behind; it is counted and left to the behavioural tests
    engine, trainer = _moe_sides("stacked")
    engine["m.l.0.mlp.experts.routed_experts.w2_weight"] = engine["m.l.0.mlp.experts.routed_experts.w2_weight"][:2]
    check = ParameterCheck()
    check.calibrate(engine.items(), trainer)
    assert (check.checked, check.total) == (2, 3)
    assert trainer_sources("m.l.0.mlp.experts.routed_experts.w2_weight", {}, set(trainer)) == [
        "m.l.0.mlp.experts.down_proj"]
    assert trainer_sources("m.l.0.mlp.experts.routed_experts.w2_weight", {}, {"m.l.0.mlp.gate.weight"}) is None
    assert trainer_sources("m.l.0.mlp.shared.w2_weight", {}, set(trainer)) is None  # not under an experts module


@pytest.mark.parametrize("lr, fingerprints", [(1e-9, "blake2b"), (1e-6, "blake2b"), (1e-5, "blake2b"),
                                               (3e-4, "blake2b"), (1e-9, "digest"), (3e-4, "digest")])
def test_healthy_syncs_leave_nothing_behind(rig, lr, fingerprints):
    model, engine, check = rig(None, fingerprints=fingerprints)
    for i in range(5):
        _adam_like_step(model, lr, seed=i)
        engine.sync_weights(model)
        metrics = check.after_sync(engine, model, what=f"sync {i + 1}")
        assert metrics["sync/ok"] == 1.0 and metrics["sync/params_left"] == 0.0, metrics
    assert check.parameters is not None
    assert check.parameters.checked == check.parameters.total - 2  # the unmapped and the empty tensor


# layer 1 in the engine's layout is 8 tensors; its two norm weights (≈ 1) move by 1e-6, below bf16's resolution
# there (2⁻⁷): their casts do not change, no verdict — the other 6 are named
@pytest.mark.parametrize("fingerprints", ["blake2b", "digest"])
@pytest.mark.parametrize("leave, left", [("model.layers.1.", 6), ("lm_head", 1)])
def test_a_part_left_behind_is_named_at_the_first_sync(rig, caplog, leave, left, fingerprints):
    model, engine, check = rig(leave, fingerprints=fingerprints)
    _adam_like_step(model, 1e-6)
    engine.sync_weights(model)
    with caplog.at_level("WARNING", logger="offpolicy.rollout.sync_check"):
        metrics = check.after_sync(engine, model, what="sync 1")
    assert metrics["sync/ok"] == 0.0 and metrics["sync/params_left"] == left
    assert f"sync 1: {left} of the engine's tensors did not change" in caplog.text and leave in caplog.text
    # at lr 1e-6 the probe moves far less than bf16's noise: the behavioural layer alone says nothing
    assert metrics["sync/gap"] <= metrics["sync/threshold"] and metrics["sync/step_rms"] < 2 * check.noise_rms


def test_the_layer_can_be_turned_off():
    from offpolicy.models import load_model

    model, tok = load_model("tiny")
    engine = FusedEngine(copy.deepcopy(model), dtype="bfloat16", tokenizer=tok, leave="model.layers.1.")
    check = SyncCheck(on_failure="warn", parameters=False)
    check.calibrate(engine, model, SyncProbe.from_text(tok))
    _adam_like_step(model, 1e-6)
    engine.sync_weights(model)
    metrics = check.after_sync(engine, model, what="sync 1")
    assert check.parameters is None and "sync/params_left" not in metrics and metrics["sync/ok"] == 1.0


def test_an_engine_whose_tensors_are_out_of_reach_is_judged_by_behaviour_alone(caplog):
    from offpolicy.models import load_model

    class Remote(HFRolloutEngine):
        def engine_parameters(self):
            raise ValueError("vLLM runs its worker in another process")

    model, tok = load_model("tiny")
    engine = Remote(copy.deepcopy(model), dtype="bfloat16", tokenizer=tok)
    check = SyncCheck(on_failure="warn")
    with caplog.at_level("WARNING", logger="offpolicy.rollout.sync_check"):
        check.calibrate(engine, model, SyncProbe.from_text(tok))
    assert check.parameters is None and "no parameter layer (vLLM runs its worker" in caplog.text
    _adam_like_step(model, 1e-3)
    engine.sync_weights(model)
    assert check.after_sync(engine, model, what="sync 1")["sync/ok"] == 1.0

