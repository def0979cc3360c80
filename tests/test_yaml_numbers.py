"""Numbers as users write them: the YAML loader (offpolicy.yaml_numbers) and the three places that read user YAML —
OFFPOLICY_VERL, the trainer's config files and its ``key=value`` overrides."""

from __future__ import annotations

import math

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.integrations.verl.settings import settings_from_text
from offpolicy.train.config import load_config
from offpolicy.yaml_numbers import NumberLoader, load_yaml

# the forms the README / docs / papers use, and Python's own float reprs; each was a string under PyYAML's YAML 1.1
WRITTEN = {"1e-4": 1e-4, "2e0": 2.0, "5E-1": 0.5, "-3e-2": -0.03, "-.5": -0.5, "+.5": 0.5, "1.0e4": 1e4,
           "1e+16": 1e16, ".5e3": 500.0, "1e-05": 1e-5, "1_000e-3": 1.0}
# what PyYAML already read as numbers keeps its meaning
KEPT = {".5": 0.5, "5.": 5.0, "1.5E+3": 1500.0, "1_000": 1000, "0x1F": 31, "3": 3, "-7": -7}
NOT_NUMBERS = ["inf", "nan", "1e", "e5", "1.2.3", "0x1p-3", "1e4.5", "--1e3", "1 e3"]


@pytest.mark.parametrize("text, value", list(WRITTEN.items()) + list(KEPT.items()))
def test_numbers_load_as_written(text, value):
    loaded = load_yaml(text)
    assert loaded == value and type(loaded) is type(value)
    assert load_yaml(f"{{x: {text}}}") == {"x": value} and load_yaml(f"[{text}]") == [value]


@pytest.mark.parametrize("text", WRITTEN)
def test_pyyaml_alone_reads_these_as_strings(text):
    # Expected: the reason the loader exists — if PyYAML ever reads them as floats, NumberLoader's resolver is moot
    assert isinstance(yaml.safe_load(text), str)


@pytest.mark.parametrize("text", NOT_NUMBERS)
def test_other_text_stays_text(text):
    assert load_yaml(text) == text


def test_quoted_numbers_stay_text_and_safe_loader_is_untouched():
    assert load_yaml("'1e-4'") == "1e-4" and load_yaml('"2e0"') == "2e0"
    assert yaml.safe_load("1e-4") == "1e-4"  # the resolver is NumberLoader's own, not patched into SafeLoader
    assert issubclass(NumberLoader, yaml.SafeLoader)
    with pytest.raises(yaml.constructor.ConstructorError):
        load_yaml("!!python/object:os.system x")  # still safe: no arbitrary objects


def _forms(x: float) -> list[str]:
    return [repr(x), f"{x:e}", f"{x:E}", f"{x:.3e}", f"{x:g}", str(x)]


@settings(max_examples=200, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=False))
def test_property_every_printed_finite_float_loads_as_its_value(x):
    for text in _forms(x):
        value = load_yaml(text)
        assert isinstance(value, (int, float)) and not isinstance(value, bool), text
        assert value == float(text), text
    assert load_yaml(repr(x)) == x and math.copysign(1, load_yaml(repr(x))) == math.copysign(1, x)


positive = st.floats(min_value=1e-300, max_value=1e300, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None)
@given(positive)
def test_property_offpolicy_verl_reads_printed_floats(x):
    for text in _forms(x):
        s = settings_from_text(f"{{correction: {{name: tis, upper: {text}}}}}")
        assert s.correction["upper"] == float(text), text
        s = settings_from_text(f'{{"correction": {{"name": "tis", "upper": {text}}}}}')  # the JSON form
        assert s.correction["upper"] == float(text), text


def test_property_config_files_and_overrides_read_printed_floats(tmp_path):
    path = tmp_path / "x.yaml"

    @settings(max_examples=40, deadline=None)
    @given(positive)
    def check(x):
        for text in _forms(x):
            path.write_text(f"algorithm:\n  is_upper: {text}\n")
            assert load_config(path).algorithm.is_upper == float(text), text
            assert load_config(None, [f"algorithm.is_upper={text}"]).algorithm.is_upper == float(text), text

    check()


def test_offpolicy_verl_readme_form_and_exponents():
    # Expected: the README's line, and exponents without a dot (which were refused as "must be a real number")
    assert settings_from_text("{correction: {name: tis, upper: 2.0}}").correction == {"name": "tis", "upper": 2.0}
    s = settings_from_text("{correction: {name: tis, upper: 2e0}, alp: {init_std: 3e-2, lr: 5E-4}, "
                           "sampling: {min_p: 1e-3}}")
    assert s.correction["upper"] == 2.0 and s.alp.init_std == 0.03 and s.alp.lr == 5e-4
    assert s.sampling.min_p == 1e-3


def test_the_doctor_reads_a_verl_config_with_exponents(tmp_path):
    from offpolicy.diagnose.doctor import load_config as doctor_config

    path = tmp_path / "verl.yaml"
    path.write_text("actor_rollout_ref:\n  actor:\n    optim:\n      lr: 1e-6\n")
    assert doctor_config(path)["actor_rollout_ref.actor.optim.lr"] == 1e-6
