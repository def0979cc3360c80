"""The vLLM server client against a live vLLM (CPU build, fp32, the embedded tiny model): the recorded answer's
format, the protocol detection, μ under every sampler setting the client passes (replayed by the trainer's own
processing), the order vLLM applies min-p and top-p in, and inspect against the server."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from offpolicy.rollout.http import post_json
from offpolicy.rollout.protocols import VLLMProtocol, parse_vllm_completion
from offpolicy.rollout.sampling import SamplingConfig
from offpolicy.rollout.scoring import sequence_logprobs
from offpolicy.rollout.servers import connect_server, detect_protocol

RECORDED = Path(__file__).parents[1] / "rollout" / "data" / "vllm_completions.json"


@pytest.fixture(scope="module")
def server(vllm_servers):
    return vllm_servers.get("tiny", "float32")


@pytest.fixture(scope="module")
def tiny():
    from offpolicy.models import load_model

    return load_model("tiny")


def _keys(obj, prefix=""):
    """Every key path of a JSON object, lists entered through their first element."""
    out = set()
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k.startswith("token_id:") or k == "_comment":
                continue
            out.add(prefix + k)
            out |= _keys(v, prefix + k + ".")
    elif isinstance(obj, list) and obj:
        out |= _keys(obj[0], prefix)
    return out


def test_the_recorded_answer_has_the_live_answers_format(server, tiny):
    # the request the recorded answer describes: prompt ids, logprobs=2, ids as "token_id:<id>", processed log-probs
    # with top_k=3; logprobs=5 here so that the live answer also shows how −inf comes back
    recorded = json.loads(RECORDED.read_text())
    _, tok = tiny
    body = {"model": str(server.model_dir), "prompt": tok("12+30=")["input_ids"], "max_tokens": 4, "logprobs": 5,
            "top_k": 3, "seed": 1, "temperature": 1.0, "return_tokens_as_token_ids": True}
    live = post_json(server.url + "/v1/completions", body, timeout=60, what="live completion")
    assert _keys(recorded) <= _keys(live), _keys(recorded) - _keys(live)
    lp = live["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") for t in lp["tokens"])
    for row, tok_key in zip(lp["top_logprobs"], lp["tokens"]):
        assert tok_key in row and len(row) in (5, 6)  # the top 5 plus the sampled token when it is not among them
        values = sorted(row.values(), reverse=True)
        assert values[3] == values[4] == -9999.0  # beyond top_k=3: −inf written as −9999.0, as recorded
    c = parse_vllm_completion(live, SamplingConfig(max_new_tokens=4, top_k=3, logprobs_topk=5))
    assert c.ids and all(math.isfinite(v) for v in c.logp)
    assert all(math.isinf(row[-1]) for row in c.top_logp)  # the −9999.0 read back as −inf


def test_the_protocol_is_detected(server):
    assert detect_protocol(server.url) == "vllm"
    engine = connect_server(server.url)
    assert isinstance(engine.protocol, VLLMProtocol) and engine.protocol.model == str(server.model_dir)


SAMPLERS = {
    "plain": SamplingConfig(max_new_tokens=8),
    "temperature": SamplingConfig(max_new_tokens=8, temperature=0.7),
    "top_k": SamplingConfig(max_new_tokens=8, top_k=5),
    "top_p": SamplingConfig(max_new_tokens=8, top_p=0.8),
    "min_p": SamplingConfig(max_new_tokens=8, min_p=0.1),
    "top_k+min_p": SamplingConfig(max_new_tokens=8, top_k=8, min_p=0.05, temperature=1.3),
    "repetition": SamplingConfig(max_new_tokens=8, repetition_penalty=1.5),
    "presence+frequency": SamplingConfig(max_new_tokens=8, presence_penalty=0.8, frequency_penalty=0.5),
    "logit_bias": SamplingConfig(max_new_tokens=8, logit_bias=((19, 3.0),)),
}


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_mu_is_what_the_trainer_replays(server, tiny, name):
    # fp32 server against the fp32 trainer: any gap beyond round-off would be a processing step applied differently
    model, tok = tiny
    cfg = SAMPLERS[name]
    engine = connect_server(server.url, vocab_size=model.config.vocab_size, tokenizer=tok)
    prompts = [tok(f"{a}+{b}=")["input_ids"] for a, b in [(3, 4), (12, 30), (77, 7), (5, 50)]]
    out = engine.generate(prompts, cfg, seed=3)
    with torch.no_grad():
        replay, mask = sequence_logprobs(model, out.prompt_ids, out.completion_ids, out.sampling)
    assert torch.equal(mask, out.mask)
    assert float((replay - out.logp).abs()[mask].max()) < 1e-4, name


def _kept(p: torch.Tensor, order: list[str], top_p: float, min_p: float) -> set[int]:
    """The tokens kept by min-p and top-p applied in ``order`` to probabilities ``p`` (each renormalised)."""
    keep = torch.ones_like(p, dtype=torch.bool)
    for step in order:
        q = torch.where(keep, p, 0.0)
        q = q / q.sum()
        if step == "min_p":
            keep &= q >= min_p * q.max()
        else:
            sorted_q, idx = q.sort()
            drop = sorted_q.cumsum(0) <= 1 - top_p
            drop[-1] = False
            keep &= ~torch.zeros_like(keep).scatter(0, idx, drop)
    return set(torch.nonzero(keep).flatten().tolist())


def test_vllm_applies_min_p_before_top_p(server, tiny):
    # why the client refuses min_p with top_p: on the live engine the kept set is min-p's first, then top-p's on
    # what min-p kept; the trainer's order (top-p first) keeps another set on the settings found below
    model, tok = tiny
    found = None
    for text in ("7+5=", "12+30=", "5 plus 8", "Use 3 and 4"):
        prompt = tok(text)["input_ids"]
        with torch.no_grad():
            z = model(torch.tensor([prompt])).logits[0, -1].float()
        for temperature in (2.0, 3.0):
            p = (z / temperature).softmax(-1)
            for top_p in (0.5, 0.7, 0.9):
                for min_p in (0.02, 0.05, 0.1, 0.2):
                    vllm_order = _kept(p, ["min_p", "top_p"], top_p, min_p)
                    if vllm_order != _kept(p, ["top_p", "min_p"], top_p, min_p) and len(vllm_order) <= 40:
                        found = (prompt, temperature, top_p, min_p, vllm_order)
                        break
                if found:
                    break
            if found:
                break
        if found:
            break
    assert found is not None, "no setting where the two orders differ: the test would show nothing"
    prompt, temperature, top_p, min_p, vllm_order = found
    body = {"model": str(server.model_dir), "prompt": prompt, "max_tokens": 1, "logprobs": 50, "top_p": top_p,
            "min_p": min_p, "temperature": temperature, "seed": 0, "return_tokens_as_token_ids": True}
    row = post_json(server.url + "/v1/completions", body, timeout=60, what="min-p + top-p")["choices"][0]
    live = {int(k.split(":")[1]) for k, v in row["logprobs"]["top_logprobs"][0].items() if v > -9999.0}
    assert live == vllm_order


def test_inspect_against_the_server_measures_the_exact_kl(server, tmp_path):
    from typer.testing import CliRunner

    from offpolicy.cli import app

    out = tmp_path / "inspect"
    res = CliRunner().invoke(app, ["inspect", "--model", "tiny", "--task", "arithmetic", "--prompts", "8",
                                   "--rollout", f"server={server.url}", "--out", str(out), "--no-layers"])
    assert res.exit_code == 0, res.output
    report = json.loads((out / "report.json").read_text())
    assert report["kl_source"] == "exact"  # --max-logprobs -1: K = V, the full distribution
    assert 0 <= report["kl_mean"] < 1e-6  # fp32 against fp32: the round-off floor
    assert report["positions"] > 0


def test_a_server_with_raw_logprobs_is_refused_at_connection(vllm_servers):
    raw = vllm_servers.get("tiny", "float32", extra_args=("--logprobs-mode", "raw_logprobs"))  # the last flag wins
    with pytest.raises(ValueError, match=rf"^logprobs_mode: the vLLM server at {raw.url} runs with --logprobs-mode "
                                         "raw_logprobs; .*restart it with --logprobs-mode processed_logprobs$"):
        connect_server(raw.url)
