"""`offpolicy inspect` and `offpolicy diagnose DUMP` through the CLI: files, the CI gate both ways, errors."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from offpolicy.cli import app
from offpolicy.inspect.figures import FIGURES

runner = CliRunner()
SMALL = ["--model", "tiny-random", "--prompts", "4", "--max-new-tokens", "6", "--ignore-eos"]


@pytest.fixture(scope="module")
def inspected(tmp_path_factory):
    out = tmp_path_factory.mktemp("inspect")
    res = runner.invoke(app, ["inspect", *SMALL, "--rollout", "w8kv8", "--out", str(out)])
    assert res.exit_code == 0, res.output
    return out, res.output


def test_inspect_writes_report_pngs_and_dump(inspected):
    out, output = inspected
    for name in ("report.html", "report.json", "tokens.jsonl", *(f"{f}.png" for f in FIGURES)):
        assert (out / name).is_file(), name
    summary = json.loads((out / "report.json").read_text())
    assert summary["positions"] == 4 * 6 and summary["meta"]["rollout"]["name"] == "w8kv8"
    assert "recommended thresholds" in output and "mean KL" in output


def _fail_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("FAIL")]


def test_gate_fails_with_one_line_per_metric(inspected, tmp_path):
    out, _ = inspected
    summary = json.loads((out / "report.json").read_text())
    res = runner.invoke(app, ["inspect", *SMALL, "--rollout", "w8kv8", "--out", str(tmp_path), "--no-layers",
                              "--fail-above", "kl=1e-12"])
    assert res.exit_code == 1, res.output
    lines = _fail_lines(res.output)
    assert lines == [f"FAIL kl_mean = {summary['kl_mean']:.4g} > 1e-12 (--fail-above)"]


def test_gate_passes_within_bounds(tmp_path):
    res = runner.invoke(app, ["inspect", *SMALL, "--out", str(tmp_path), "--no-layers",
                              "--fail-above", "kl=1e-3,max_kl=0.05"])
    assert res.exit_code == 0, res.output  # a bf16 engine on the random tiny model: mean KL ~1e-5, max ~1e-4
    assert not _fail_lines(res.output) and "within bounds: kl_mean ≤ 0.001, kl_max ≤ 0.05" in res.output


def test_diagnose_reads_the_dump_back(inspected, tmp_path):
    out, _ = inspected
    res = runner.invoke(app, ["diagnose", str(out / "tokens.jsonl"), "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    a = json.loads((out / "report.json").read_text())
    b = json.loads((tmp_path / "report.json").read_text())
    for key in ("positions", "sequences", "kl_source", "kl_mean", "kl_max", "tv_mean", "tv_max", "kl_reverse_mean",
                "topk_overlap_mean", "sampled_abs_delta_mean", "pearson_r", "ess", "chi2_token", "chi2_seq", "k3_kl",
                "sampled_tail", "presets"):
        assert a[key] == b[key], key
    for name in ("trm_max", "trm_avg", "mis", "opsm", "veto"):
        assert a["recommended"][name] == b["recommended"][name], name
    assert b["layers"] is None and "dvp" not in b["recommended"]  # these need the model
    # the gate works on a dump too, both ways
    res = runner.invoke(app, ["diagnose", str(out / "tokens.jsonl"), "--out", str(tmp_path), "--fail-above",
                              f"max_kl={a['kl_max'] / 2}"])
    assert res.exit_code == 1 and len(_fail_lines(res.output)) == 1 and "kl_max" in _fail_lines(res.output)[0]
    res = runner.invoke(app, ["diagnose", str(out / "tokens.jsonl"), "--out", str(tmp_path), "--fail-above",
                              f"max_kl={a['kl_max'] * 2}"])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("content, needle", [
    ("", "empty file: no records"),
    ('{"schema_version": 1, "completion_ids": [1, 2], "rollout_logp": [-1.0, -1.0]}\n',
     "record 1, field 'trainer_logp': missing"),
    ('{"schema_version": 1, "completion_ids": [1, 2], "rollout_logp": [-1.0], "trainer_logp": [-1.0, -1.0]}\n',
     "record 1, field 'rollout_logp': has 1 values but completion_ids has 2"),
    ('{"schema_version": 1, "completion_ids": [1], "rollout_logp": ["nan"], "trainer_logp": [-1.0]}\n',
     "record 1, field 'rollout_logp': position 0 is a valid (mask 1) position"),
])
def test_diagnose_malformed_dump_is_one_line(tmp_path, content, needle):
    path = tmp_path / "tokens.jsonl"
    path.write_text(content)
    if not content:  # an empty .jsonl is not recognisable as a dump by content: name it as one by its suffix
        path = tmp_path / "tokens.pt"
        path.write_bytes(b"")
    res = runner.invoke(app, ["diagnose", str(path)])
    assert res.exit_code == 2
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(path) in errors[0] and needle in errors[0], res.output


@pytest.mark.parametrize("args, needle", [
    (["--rollout", "bf17"], "--rollout: unknown engine 'bf17'"),
    (["--trainer", "fp32,kv_cache_bits=4"], "--trainer: kv_cache_bits"),
    (["--rollout", "bf16", "--rollout", "fp16", "--trainer", "fp32", "--trainer", "fp32", "--trainer", "fp32"],
     "--trainer: give one, or one per --rollout (2), not 3"),
    (["--fail-above", "kl"], "--fail-above: 'kl' is not metric=bound"),
    (["--fail-above", "kl=abc"], "the bound of 'kl' is 'abc'"),
    (["--fail-above", "colour=1"], "--fail-above: unknown metric 'colour'"),
    (["--model", "/nonexistent/model"], "--model '/nonexistent/model' is not 'tiny', 'lab', 'lab-moe', 'tiny-random' or a local"),
    (["--task", "sudoku"], "unknown task 'sudoku'"),
    (["--rollout-view", "logits"], "--rollout-view must be full or topk"),
    (["--top-p", "0.9", "--rollout-view", "topk"], "untruncated sampling"),
])
def test_bad_arguments_are_one_line(tmp_path, args, needle):
    res = runner.invoke(app, ["inspect", *SMALL, "--out", str(tmp_path), "--no-layers", *args])
    assert res.exit_code == 2, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], res.output


def test_several_engines_make_a_table(tmp_path):
    res = runner.invoke(app, ["inspect", *SMALL, "--out", str(tmp_path), "--no-layers", "--rollout", "fp16",
                              "--rollout", "fp32-head", "--trainer", "fp16-autocast", "--trainer", "fp32"])
    assert res.exit_code == 0, res.output
    table = (tmp_path / "table.md").read_text().splitlines()
    assert table[2].startswith("| fp16 | fp16-autocast |") and table[3].startswith("| fp32-head | fp32 |")
    assert (tmp_path / "fp16__fp16-autocast" / "report.html").is_file()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_local_model_directory(tmp_path, kind):
    """A tiny random Llama / Qwen2 saved with save_pretrained (no download), inspected by path."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from offpolicy.models.tokenizer import build_tokenizer

    tok = build_tokenizer()
    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if kind == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    config = config_cls(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model_cls(config).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    res = runner.invoke(app, ["inspect", "--model", str(tmp_path / "model"), "--prompts", "3", "--max-new-tokens", "4",
                              "--rollout", "bf16,weight_bits=4,quantize_layers=1", "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    summary = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [x["name"] for x in summary["layers"]] == ["embed", "layer.0", "layer.1", "layer.2", "final_norm", "logits"]
    assert summary["first_divergent_layer"] == "embed"  # bf16 parameters: rounded from the embeddings on


def test_gate_metric_names_match_the_report(inspected):
    """Every metric the gate accepts is a numeric key of report.json, and the other way round."""
    from offpolicy.inspect.gate import ALIASES, REPORT_METRICS

    out, _ = inspected
    summary = json.loads((out / "report.json").read_text())
    settings = {"positions", "sequences", "report_version", "layer_threshold"}  # numbers, but not measurements
    numeric = {k for k, v in summary.items() if (v is None or isinstance(v, (int, float))) and not isinstance(v, bool)}
    # None here only when absent (routing, beside: blocks of an MoE model / a model measured beside)
    numeric -= settings | {"first_divergent_layer", "largest_share_layer", "layers", "routing", "beside"}
    assert numeric == REPORT_METRICS
    assert set(ALIASES.values()) <= REPORT_METRICS


def test_help_and_metrics_files(tmp_path):
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0 and "inspect" in res.output
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "reward/mean": 0.5}\n')
    res = runner.invoke(app, ["diagnose", str(metrics), "--fail-above", "kl=1"])
    assert res.exit_code == 2 and "--fail-above applies to per-token dumps" in res.output


def test_public_names():
    import offpolicy.inspect as inspect_api

    assert len(inspect_api.__all__) == len(set(inspect_api.__all__))
    assert [name for name in inspect_api.__all__ if not hasattr(inspect_api, name)] == []
