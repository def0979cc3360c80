"""The version matrix: a framework installed outside the tested range warns once per process (never an error), inside
it nothing is said; the TRL trainer and the verl plug-in both check when they start."""

from __future__ import annotations

import warnings

import pytest

from offpolicy.integrations import versions
from offpolicy.integrations.versions import VERSIONS, UntestedVersionWarning, check_versions, version_tuple


@pytest.fixture(autouse=True)
def _fresh_warning_memory(monkeypatch):
    monkeypatch.setattr(versions, "_WARNED", set())


@pytest.mark.parametrize("package, inside, outside", [
    ("torch", ["2.2.0", "2.13.0+cpu", "2.14.9"], ["2.1.2", "2.15.0", "3.0.0"]),
    ("trl", ["1.16.0", "1.16.3"], ["1.15.9", "1.17.0", "0.20.0", "2.0.0"]),
    ("verl", ["0.9.0", "0.9.1"], ["0.8.9", "0.10.0", "1.0.0"]),
    ("vllm", ["0.22.0", "0.31.1", "0.32.0"], ["0.21.0", "0.33.0"]),
])
def test_the_ranges(package, inside, outside):
    assert all(VERSIONS[package].supports(v) for v in inside)
    assert not any(VERSIONS[package].supports(v) for v in outside)


def test_outside_the_range_warns_once_naming_both_versions():
    with pytest.warns(UntestedVersionWarning) as caught:
        first = check_versions("trl", "verl", user="X", installed={"trl": "1.18.0", "verl": "0.9.1"})
    assert first == ["X was tested with trl 1.16.0 (supported >=1.16,<1.17); trl 1.18.0 is installed: run "
                     "tests/integrations to check it"]
    assert len(caught) == 1 and str(caught[0].message) == first[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same package and version again: said already, not again
        assert check_versions("trl", user="X", installed={"trl": "1.18.0"}) == first


def test_inside_the_range_or_not_installed_says_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_versions("trl", "vllm", user="X", installed={"trl": "1.16.0", "vllm": None}) == []
    with pytest.raises(ValueError, match="unknown package 'tensorflow'"):
        check_versions("tensorflow", user="X")
    with pytest.raises(ValueError, match="version must start with a number"):
        version_tuple("latest")


def test_the_installed_versions_are_read_from_the_metadata():
    import torch

    assert versions.installed_version("torch") == torch.__version__
    assert versions.installed_version("no-such-package-here") is None


@pytest.mark.slow  # importing TRL and building its trainer: ~10 s on 2 quiet cores, ~20 s on shared ones
def test_the_trl_trainer_warns_outside_the_matrix(tmp_path, monkeypatch):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    from trl import GRPOConfig
    from trl_toy import toy_dataset, varied_reward  # tests/support

    from offpolicy.integrations.trl import OffPolicyGRPOTrainer
    from offpolicy.models.tiny import build_tiny_model

    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda p: "1.99.0" if p == "trl" else real(p))
    model, tok = build_tiny_model(seed=0)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, max_steps=1, report_to=[], use_cpu=True, bf16=False, beta=0.0)
    with pytest.warns(UntestedVersionWarning, match="offpolicy's TRL trainer was tested with trl 1.16.0"):
        OffPolicyGRPOTrainer(model=model, reward_funcs=varied_reward, args=args, train_dataset=toy_dataset(),
                             processing_class=tok)


def test_the_verl_plugin_warns_outside_the_matrix(monkeypatch):
    pytest.importorskip("verl")
    from offpolicy.integrations.verl import plugin

    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda p: "0.10.0" if p == "verl" else real(p))
    with pytest.warns(UntestedVersionWarning, match="offpolicy's verl plug-in was tested with verl 0.9.1"):
        plugin.install()
