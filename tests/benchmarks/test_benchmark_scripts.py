"""The benchmark scripts that a CI or GPU run relies on, run on tiny shapes on CPU: benchmarks/gpu.py (everything but
the CUDA timings and memory), benchmarks/vocab_memory.py (two arms, each in its own subprocess)."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # the tiny random model in bf16 and fp32: 57 s at load average 8–13 on 2 cores
def test_gpu_script_runs_on_cpu_and_writes_one_json(tmp_path):
    out = tmp_path / "gpu.json"
    result = _script("gpu").main(["--device", "cpu", "--quick", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["shape"] == result["shape"] and saved["shape"]["vocab"] == 1000
    arms = saved["kernels"]["32"]
    assert {"naive", "op_logp", "op_logp_entropy", "op_dvp"} <= set(arms)
    for name, row in arms.items():
        assert "error" not in row, (name, row)
        assert row["time_s"] > 0 and row["peak_mib"] is None  # no allocator peak off CUDA
    # offpolicy's kernels take float32 logits of the bf16 inputs: they match the exact log-probs; the naive path
    # rounds its logits to bf16 first
    assert arms["op_logp"]["max_abs_diff"] < 1e-4 and arms["op_logp_entropy"]["max_abs_diff"] < 1e-4
    assert "max_abs_diff" not in arms["op_dvp"]
    m = saved["mismatch"]
    assert m["tokens"] > 0 and 0 < m["mean_abs_dlogp"] <= m["max_abs_dlogp"] and m["mean_k3"] >= 0


@pytest.mark.slow  # two subprocesses importing torch and TRL: 92 s at load average 8–13 on 2 cores
def test_vocab_memory_script_reports_ratios_to_the_baseline():
    results = _script("vocab_memory").run_arms(["trl_head", "op_center"], n=64, h=16, v=500, k=4, dtype="fp32",
                                               reps=1, budget_mib=1.0, threads=1, repeat=2, echo=lambda *a: None)
    for arm, r in results.items():
        assert "error" not in r, (arm, r)
        assert r["extra_mib"] >= 0 and r["cpu_s"] > 0 and len(r["runs"]) == r["repeats"] == 2
    assert "mem_ratio" not in results["trl_head"]
    centre, head = results["op_center"]["runs"], results["trl_head"]["runs"]
    ratios = [c["mem_ratio"] for c in centre]
    for c, h in zip(centre, head):  # each repeat's ratio is to the baseline of the same repeat
        assert math.isclose(c["mem_ratio"], c["extra_mib"] / max(h["extra_mib"], 1e-9))
        assert math.isclose(c["cpu_ratio"], c["cpu_s"] / h["cpu_s"])
    assert math.isclose(results["op_center"]["mem_ratio"], sum(ratios) / 2)  # the median of two
    assert results["op_center"]["mem_ratio_range"] == [min(ratios), max(ratios)]


def test_trl_overhead_puts_trls_vllm_init_back_on_exit():
    # the benchmark swaps TRL's VLLMGeneration._init_vllm for its in-process engine client while a trainer is built;
    # after the block (an exception included) TRL's own method is back, so nothing else in the process sees the stub
    pytest.importorskip("trl")
    from trl.generation import vllm_generation as vg

    from offpolicy.models.tiny import build_tiny_model

    bench = _script("trl_overhead")
    model, tok = build_tiny_model(seed=0)
    original = vg.VLLMGeneration._init_vllm
    with bench.engine_client(model, tok) as client:
        assert vg.VLLMGeneration._init_vllm is not original
        holder = object.__new__(vg.VLLMGeneration)
        vg.VLLMGeneration._init_vllm(holder)
        assert holder.vllm_client is client
    assert vg.VLLMGeneration._init_vllm is original
    with pytest.raises(RuntimeError, match="inside"), bench.engine_client(model, tok):
        raise RuntimeError("inside")
    assert vg.VLLMGeneration._init_vllm is original


def test_an_overhead_record_is_written_whole(tmp_path):
    from types import SimpleNamespace

    from offpolicy_testkit.bench_record import write_record

    path = tmp_path / "record.json"
    path.write_text("an older record")
    write_record(path, SimpleNamespace(repeat=3), [1.0, 1.2], {"vanilla": [0.9]}, {"vanilla": {"ratio": 1.0}})
    assert json.loads(path.read_text()) == {"args": {"repeat": 3}, "loads": [1.0, 1.2], "runs": {"vanilla": [0.9]},
                                            "table": {"vanilla": {"ratio": 1.0}}}
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]  # no temporary file left behind


@pytest.mark.slow  # four short trainings of the tiny model through TRL's async train(): ≈ 40 s on 2 cores
def test_trl_async_overhead_runs_every_arm_and_records_ratios_to_vanilla(tmp_path):
    pytest.importorskip("trl.experimental.async_grpo")
    out = tmp_path / "async.json"
    result = _script("trl_async_overhead").main(["--model", "tiny", "--repeat", "1", "--steps", "1", "--batch", "8",
                                                  "--new-tokens", "4", "--only", "tis", "decoupled_loglinear",
                                                  "sync_check", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert set(saved["runs"]) == {"vanilla", "tis", "decoupled_loglinear", "sync_check"}
    assert saved["args"]["model"] == "tiny" and len(saved["loads"]) == 4
    table = saved["table"]["cpu"]
    assert table["vanilla"] == {**table["vanilla"], "ratio": 1.0, "low": 1.0, "high": 1.0}
    for arm, row in table.items():  # a ratio is the arm's step over vanilla's in the same repeat
        run, base = saved["runs"][arm][0], saved["runs"]["vanilla"][0]
        assert row["ratio"] == pytest.approx(run["cpu"] / base["cpu"]) and row["step_s"] > 0, arm
        assert 0 < run["transfer_cpu"] < run["cpu"], arm  # each step's transfer is in its time, less the sampling
    assert result["table"] == table and "load average" in saved["table"]["uptime"][0]
    with pytest.raises(SystemExit, match="unknown arms"):
        _script("trl_async_overhead").main(["--only", "vtrace"])
