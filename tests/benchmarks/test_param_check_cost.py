"""benchmarks/param_check_cost.py: the Qwen2.5 parameter lists it builds, the bytes its real ParameterCheck reads on
them (both sides, every tensor checked), and its fit."""

import math

from offpolicy_testkit.script_module import load_script


def _bench():
    return load_script("benchmarks/param_check_cost.py")


def test_the_parameter_lists_have_qwen25s_sizes():
    bench = _bench()
    # the totals of the released checkpoints (tied heads counted once)
    assert [bench.parameters(s) for s in ("0.5B", "1.5B", "3B")] == [494_032_768, 1_543_714_304, 3_085_938_688]


def test_a_snapshot_reads_both_sides_once_in_the_engines_dtype(monkeypatch, tmp_path):
    bench = _bench()
    monkeypatch.setattr(bench, "VOCAB", 96)
    monkeypatch.setitem(bench.QWEN25, "toy", (16, 40, 2, 4, 2, 4, True))
    monkeypatch.setitem(bench.QWEN25, "toy-untied", (16, 40, 2, 4, 2, 4, False))
    out = tmp_path / "cost.json"
    table = bench.main(["--sizes", "toy", "toy-untied", "--repeat", "2", "--digest-repeat", "1", "--project",
                        "toy", "--json", str(out)])
    hashed = {r["size"]: r for r in table["measured"]}
    for size, row in hashed.items():
        # per layer 7 engine tensors: qkv_proj (weight, bias), o_proj, gate_up_proj, down_proj, two norms; all checked
        layers = bench.QWEN25[size][2]
        assert row["checked"] == row["total"] == 2 + (not bench.QWEN25[size][-1]) + layers * 7
        assert row["bytes"] == 2 * 2 * bench.parameters(size) and len(row["seconds"]) == 2
    assert table["projected"][0]["bytes"] == hashed["toy"]["bytes"] and out.exists()


def test_the_fit_recovers_a_line_and_never_a_negative_intercept():
    bench = _bench()
    rows = [{"bytes": b, "min_s": 0.5 + b / 2e9} for b in (1e9, 3e9, 6e9)]
    a, throughput = bench.fit(rows)
    assert math.isclose(a, 0.5, rel_tol=1e-9) and math.isclose(throughput, 2e9, rel_tol=1e-9)
    slowed = [{"bytes": 1e9, "min_s": 1.0}, {"bytes": 3e9, "min_s": 4.0}, {"bytes": 6e9, "min_s": 10.0}]
    a, throughput = bench.fit(slowed)  # the free fit's intercept is negative: the line goes through 0
    assert a == 0.0 and math.isclose(throughput, (1 + 9 + 36) * 1e18 / (1e9 + 12e9 + 60e9), rel_tol=1e-9)
