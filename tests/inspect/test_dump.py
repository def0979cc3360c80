"""The per-token dump: round trip, and one clear line for every kind of malformed file."""

from __future__ import annotations

import json
import math

import pytest
import torch

from offpolicy.inspect.dump import SCHEMA_VERSION, DumpError, read_dump, write_dump
from offpolicy.inspect.measurements import TokenData


def _tokens() -> TokenData:
    # two sequences of 3 tokens; the second has a masked middle token, the first a −inf trainer log-prob (π = 0 for a
    # token μ sampled) and with it an infinite KL
    return TokenData(
        completion_ids=torch.tensor([[5, 6, 7], [8, 9, 10]]), mask=torch.tensor([[True, True, True], [True, False, True]]),
        rollout_logp=torch.tensor([[-0.5, -1.0, -2.0], [-0.1, 0.0, -3.0]]),
        trainer_logp=torch.tensor([[-0.6, -0.9, -float("inf")], [-0.2, 0.0, -3.5]]),
        kl=torch.tensor([[0.01, 0.02, float("inf")], [0.001, 0.0, 0.3]]), kl_kind="exact",
        tv=torch.tensor([[0.1, 0.2, 0.9], [0.05, 0.0, 0.4]]),
        topk_ids=torch.tensor([[[5, 1], [6, 1], [7, 1]], [[8, 1], [0, 0], [10, 1]]]),
        rollout_topk_logp=torch.tensor([[[-0.5, -2.0]] * 3, [[-0.1, -3.0], [0.0, 0.0], [-3.0, -0.2]]]),
        trainer_topk_logp=torch.tensor([[[-0.6, -float("inf")]] * 3, [[-0.2, -2.5], [0.0, 0.0], [-3.5, -0.1]]]),
        advantages=torch.tensor([1.0, -0.5]), prompt_ids=[[1, 2], [1, 3, 4]],
    )


def test_round_trip(tmp_path):
    t = _tokens()
    path = write_dump(t, tmp_path / "tokens.jsonl")
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first["schema_version"] == SCHEMA_VERSION and first["trainer_logp"][2] == "-inf"
    assert first["kl"][2] == "inf" and "mask" not in first  # all valid: no mask written
    assert json.loads(lines[1])["mask"] == [1, 0, 1]
    back = read_dump(path)
    for name in ("completion_ids", "mask", "advantages"):
        assert torch.equal(getattr(back, name), getattr(t, name)), name
    m = t.mask
    for name in ("rollout_logp", "trainer_logp", "kl", "tv"):
        assert torch.equal(getattr(back, name)[m], getattr(t, name)[m]), name
    assert back.kl_kind == "exact" and back.prompt_ids == t.prompt_ids
    assert torch.equal(back.topk_ids[m], t.topk_ids[m])
    assert torch.equal(back.trainer_topk_logp[m], t.trainer_topk_logp[m])


def _write(tmp_path, records, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


GOOD = {"schema_version": 1, "completion_ids": [3, 4], "rollout_logp": [-1.0, -2.0], "trainer_logp": [-1.1, -2.2]}


@pytest.mark.parametrize("record, field, needle", [
    ({k: v for k, v in GOOD.items() if k != "trainer_logp"}, "trainer_logp", "missing"),
    ({k: v for k, v in GOOD.items() if k != "schema_version"}, "schema_version", "missing"),
    ({**GOOD, "schema_version": 2}, "schema_version", "is 2; this offpolicy reads version 1"),
    ({**GOOD, "rollout_logp": [-1.0]}, "rollout_logp", "has 1 values but completion_ids has 2"),
    ({**GOOD, "mask": [1, 1, 0]}, "mask", "has 3 values but completion_ids has 2"),
    ({**GOOD, "trainer_logp": [-1.0, "nan"]}, "trainer_logp", "position 1 is a valid (mask 1) position and holds 'nan'"),
    ({**GOOD, "trainer_logp": [-1.0, None]}, "trainer_logp", "position 1 is a valid (mask 1) position"),
    ({**GOOD, "rollout_logp": [-1.0, "inf"]}, "rollout_logp", "position 1 is a valid (mask 1) position"),
    ({**GOOD, "kl": [0.1, "-inf"]}, "kl", "position 1 is a valid"),
    ({**GOOD, "rollout_logp": [-1.0, "x"]}, "rollout_logp", "position 1: string 'x' is not a number"),
    ({**GOOD, "completion_ids": [3, 4.5]}, "completion_ids", "must be a list of integers"),
    ({**GOOD, "completion_ids": [], "rollout_logp": [], "trainer_logp": []}, "completion_ids", "is empty"),
    ({**GOOD, "kl": [0.1, 0.2], "kl_kind": "approx"}, "kl_kind", "must be 'exact' or 'topk'"),
    ({**GOOD, "topk_ids": [[1], [2]]}, "rollout_topk_logp", "come together"),
    ({**GOOD, "advantage": "big"}, "advantage", "string 'big' is not a number"),
])
def test_malformed_record_names_file_record_and_field(tmp_path, record, field, needle):
    path = _write(tmp_path, [GOOD, record])
    with pytest.raises(DumpError) as err:
        read_dump(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: record 2, field {field!r}: "), msg
    assert needle in msg and "\n" not in msg


def test_nan_literal_from_python_json_is_refused(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + '{"schema_version": 1, "completion_ids": [1], "rollout_logp": [NaN], '
                    '"trainer_logp": [-1.0]}\n')
    with pytest.raises(DumpError, match=r"d.jsonl: record 2, field 'rollout_logp': position 0 is a valid"):
        read_dump(path)


def test_masked_positions_may_hold_anything(tmp_path):
    rec = {**GOOD, "mask": [1, 0], "trainer_logp": [-1.0, None], "rollout_logp": [-1.0, "nan"]}
    t = read_dump(_write(tmp_path, [rec]))
    assert t.mask.tolist() == [[True, False]] and t.trainer_logp.tolist() == [[-1.0, 0.0]]


@pytest.mark.parametrize("content, needle", [
    ("", "empty file: no records"),
    ("\n\n", "empty file: no records"),
    ('{"schema_version": 1,\n', "record 1: not valid JSON"),
    ('[1, 2]\n', "record 1: is a JSON list, not an object"),
])
def test_malformed_files(tmp_path, content, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DumpError) as err:
        read_dump(path)
    assert str(err.value).startswith(str(path)) and needle in str(err.value)


def test_a_field_in_some_records_only(tmp_path):
    path = _write(tmp_path, [GOOD, {**GOOD, "kl": [0.1, 0.2]}])
    with pytest.raises(DumpError, match=r"record 2, field 'kl': present here but missing in the first record"):
        read_dump(path)
    with pytest.raises(DumpError, match="no such file"):
        read_dump(tmp_path / "nope.jsonl")


def test_records_are_named_by_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + json.dumps({**GOOD, "trainer_logp": [0.0]}) + "\n")
    with pytest.raises(DumpError, match=r"d.jsonl: record 3, field 'trainer_logp'"):
        read_dump(path)
    assert not math.isnan(read_dump(_write(tmp_path, [GOOD])).trainer_logp.sum())
