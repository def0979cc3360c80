"""diagnose on other frameworks' data: verl's batch tensors and TRL's GRPO inputs, by their own key names."""

from __future__ import annotations

import json
import math

import pytest
import torch

from offpolicy.diagnose.dumps import (
    DumpError,
    is_dump,
    load_dumps,
    measurements_from_dumps,
    read_any,
    topk_kl_from_logprobs,
)
from offpolicy.inspect.summary import summarize

# Two sequences; valid tokens: row 0 all three, row 1 the first two.
IDS = torch.tensor([[11, 12, 13], [14, 15, 0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
ROLLOUT = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -3.0, 0.0]])
# log π − log μ = (0, 0, ln 2), (0, −ln 2): k3 = e^r − 1 − r = 0, 0, 1 − ln 2 = 0.30685, 0, e^{−ln 2} − 1 + ln 2 = 0.19315
TRAINER = ROLLOUT + torch.tensor([[0.0, 0.0, math.log(2)], [0.0, -math.log(2), 0.0]])
K3_MEAN = (0.306853 + 0.193147) / 5  # = 0.1


def verl_batch() -> dict:
    return {"responses": IDS, "response_mask": MASK, "rollout_log_probs": ROLLOUT, "old_log_probs": TRAINER,
            "prompts": torch.tensor([[0, 1, 7], [1, 8, 9]]), "attention_mask": torch.tensor([[0, 1, 1, 1, 1, 1],
                                                                                             [1, 1, 1, 1, 1, 0]]),
            "advantages": torch.tensor([[0.5, 0.5, 0.5], [-1.0, -1.0, 0.0]])}


def trl_inputs() -> dict:
    return {"completion_ids": IDS, "completion_mask": MASK, "sampling_per_token_logps": ROLLOUT,
            "old_per_token_logps": TRAINER, "prompt_ids": torch.tensor([[0, 1, 7], [1, 8, 9]]),
            "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]), "advantages": torch.tensor([0.5, -1.0])}


@pytest.mark.parametrize("fmt, make", [("verl", verl_batch), ("trl", trl_inputs)])
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_tensor_files_by_their_key_names(tmp_path, fmt, make, suffix):
    path = tmp_path / f"batch{suffix}"
    if suffix == ".pt":
        torch.save(make(), path)
    else:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in make().items()}, str(path))
    assert is_dump(path)
    t, got = read_any(path)
    assert got == fmt
    assert t.mask.tolist() == [[True, True, True], [True, True, False]]
    assert torch.equal(t.rollout_logp[t.mask], ROLLOUT[MASK.bool()])
    assert torch.equal(t.trainer_logp[t.mask], TRAINER[MASK.bool()])
    assert t.prompt_ids == [[1, 7], [1, 8, 9]]  # left padding stripped
    assert t.advantages.tolist() == [0.5, -1.0]
    summary = summarize(measurements_from_dumps([path]))
    assert summary["kl_source"] == "k3 of the sampled token"
    assert summary["kl_mean"] == pytest.approx(K3_MEAN, abs=1e-6)
    assert summary["kl_max"] == pytest.approx(1 - math.log(2), abs=1e-6)
    assert summary["sampled_abs_delta_max"] == pytest.approx(math.log(2), abs=1e-6)


def test_jsonl_records_by_their_key_names(tmp_path):
    verl = tmp_path / "verl.jsonl"
    verl.write_text("\n".join(json.dumps({"responses": IDS[i, :n].tolist(), "response_mask": [1] * n,
                                          "rollout_log_probs": ROLLOUT[i, :n].tolist(),
                                          "old_log_probs": TRAINER[i, :n].tolist(), "prompts": [1, 7 + i],
                                          "advantages": [0.5, -1.0][i]}) for i, n in ((0, 3), (1, 2))) + "\n")
    trl = tmp_path / "trl.jsonl"
    trl.write_text("\n".join(json.dumps({"completion_ids": IDS[i].tolist(), "completion_mask": MASK[i].tolist(),
                                         "sampling_per_token_logps": ROLLOUT[i].tolist(),
                                         "old_per_token_logps": TRAINER[i].tolist()}) for i in range(2)) + "\n")
    (a, fa), (b, fb) = read_any(verl), read_any(trl)
    assert (fa, fb) == ("verl", "trl") and a.prompt_ids == [[1, 7], [1, 8]] and a.advantages.tolist() == [0.5, -1.0]
    for t in (a, b):
        assert torch.equal(t.trainer_logp[t.mask], TRAINER[MASK.bool()])
    both, formats = load_dumps([verl, trl])
    assert formats == ["verl", "trl"] and both.mask.shape == (4, 3) and int(both.mask.sum()) == 10


def test_trl_nan_means_unscored_and_is_left_out(tmp_path):
    data = trl_inputs()
    data["sampling_per_token_logps"] = ROLLOUT.clone()
    data["sampling_per_token_logps"][0, 1] = math.nan
    path = tmp_path / "trl.pt"
    torch.save(data, path)
    with pytest.warns(UserWarning, match="1 token"):
        t, _ = read_any(path)
    assert t.mask.tolist() == [[True, False, True], [True, True, False]]


@pytest.mark.parametrize("fmt, make, change, needle", [
    ("verl", verl_batch, {"old_log_probs": None}, "field 'old_log_probs' missing (verl dump needs responses, "),
    ("trl", trl_inputs, {"old_per_token_logps": None}, "field 'old_per_token_logps' missing"),
    ("verl", verl_batch, {"rollout_log_probs": ROLLOUT[:, :2]}, "field 'rollout_log_probs' has shape (2, 2)"),
    ("verl", verl_batch, {"old_log_probs": torch.where(torch.eye(2, 3).bool(), math.nan, TRAINER)},
     "record 1, field 'old_log_probs': position 0 is a valid (mask 1) position and holds nan"),
    ("verl", verl_batch, {"response_mask": torch.zeros(2, 3, dtype=torch.long)}, "no valid token in any record"),
])
def test_malformed_framework_dumps(tmp_path, fmt, make, change, needle):
    data = make()
    for k, v in change.items():
        if v is None:
            data.pop(k)
        else:
            data[k] = v
    path = tmp_path / "bad.pt"
    torch.save(data, path)
    with pytest.raises(DumpError) as err:
        read_any(path)
    assert str(err.value).startswith(f"{path}: ") and needle in str(err.value)


def test_unreadable_and_foreign_files(tmp_path):
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(DumpError, match="empty.pt: empty file"):
        read_any(empty)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a torch file")
    with pytest.raises(DumpError, match="junk.pt: cannot be read as .pt tensors"):
        read_any(junk)
    other = tmp_path / "other.pt"
    torch.save({"logits": torch.zeros(1)}, other)
    with pytest.raises(DumpError, match="neither verl's"):
        read_any(other)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "reward/mean": 0.5}\n')
    assert not is_dump(metrics)  # a training run's metrics: the old diagnose path
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text('{"responses": [1, 2], "response_mask": [1, 1], "rollout_log_probs": [-1.0], '
                     '"old_log_probs": [-1.0, -2.0]}\n')
    with pytest.raises(DumpError, match=r"rows.jsonl: record 1, field 'rollout_log_probs': has 1 values"):
        read_any(jsonl)


def test_topk_kl_by_hand():
    # μ's top-2 (½, ¼) and π's log-probs at those ids (¼, ¼): rest buckets ¼ and ½:
    # ½ log 2 + ¼ log 1 + ¼ log(¼ / ½) = 0.34657 − 0.17329 = 0.17329
    q = torch.tensor([0.5, 0.25]).log()
    p = torch.tensor([0.25, 0.25]).log()
    assert topk_kl_from_logprobs(q, p).item() == pytest.approx(0.173287, abs=1e-6)
    assert topk_kl_from_logprobs(q, q).item() == pytest.approx(0.0, abs=1e-7)
