"""The doctor's thresholds as settings (grpo_lab/doctor/thresholds.py, GRPOConfig.doctor_thresholds):
the defaults are the table of docs/troubleshooting.md, overrides are checked, and a config keeps them."""

import ast
import re
from pathlib import Path

import pytest

from grpo_lab import GRPOConfig
from grpo_lab.doctor.thresholds import BY_NAME, DEFAULTS, KINDS, TABLE, Thresholds, resolve

DOCS = Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md"


def _cells(line: str) -> list[str]:
    """The cells of a markdown table row (``\\|`` is a pipe inside a cell)."""
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def _documented() -> list[list[str]]:
    """The rows of the table under the 'Thresholds' heading."""
    section = DOCS.read_text().split("\n## Thresholds", 1)[1].split("\n## ", 1)[0]
    rows = [_cells(line) for line in section.splitlines() if line.startswith("| `")]
    assert rows, "no table under '## Thresholds' in docs/troubleshooting.md"
    return rows


def test_the_defaults_are_the_documented_table():
    rows = _documented()
    assert [row[0].strip("`") for row in rows] == [threshold.name for threshold in TABLE]
    finding_codes = set(re.findall(r"^\| `([a-z_]+)` \|", DOCS.read_text().split("\n## Thresholds")[0], re.M))
    for (name, default, values, meaning, governs), threshold in zip(rows, TABLE):
        documented = ast.literal_eval(default.strip("`"))
        expected = list(threshold.default) if isinstance(threshold.default, tuple) else threshold.default
        assert documented == expected, name
        in_force = getattr(DEFAULTS, threshold.name)
        assert (list(in_force) if isinstance(in_force, tuple) else in_force) == documented, name
        assert values == KINDS[threshold.kind], name
        assert meaning, name
        codes = re.findall(r"`([a-z_]+)`", governs)
        assert codes == list(threshold.governs), name
        assert set(codes) <= finding_codes, f"{name} governs a code no finding table lists"
    assert resolve(None) is DEFAULTS and resolve({}) == DEFAULTS == Thresholds()


def test_the_docs_name_no_threshold_as_a_module_constant():
    text = DOCS.read_text()
    assert "module constant" not in text
    for threshold in TABLE:
        assert threshold.name.upper() not in text


def test_an_override_replaces_only_its_threshold():
    thresholds = resolve({"truncation_warning": 0.2, "persistent_steps": 3.0, "correctness_names": ["score"]})
    assert thresholds.truncation_warning == 0.2 and thresholds.persistent_steps == 3
    assert isinstance(thresholds.persistent_steps, int) and thresholds.correctness_names == ("score",)
    unchanged = [t.name for t in TABLE if t.name not in ("truncation_warning", "persistent_steps", "correctness_names")]
    assert all(getattr(thresholds, name) == getattr(DEFAULTS, name) for name in unchanged)
    assert resolve('{"kl_warning": 0.3}').kl_warning == 0.3  # a JSON string, as the command line gives it


@pytest.mark.parametrize(("overrides", "expected"), [
    ({"truncation_warn": 0.2}, r"unknown threshold 'truncation_warn'\. Did you mean 'truncation_warning'\?"),
    ({"TRUNCATION_WARNING": 0.2}, r"'TRUNCATION_WARNING'\. Did you mean 'truncation_warning'\?"),
    ({"persistant_steps": 2}, r"Did you mean 'persistent_steps'\?"),
    ({"xyzzy": 1}, r"unknown threshold 'xyzzy'\. Every threshold, with its default and meaning, is listed in "
                   r"docs/troubleshooting\.md"),
])
def test_an_unknown_name_is_refused_with_the_nearest_one_and_where_all_are_listed(overrides, expected):
    with pytest.raises(ValueError, match=expected) as raised:
        resolve(overrides)
    assert "docs/troubleshooting.md" in str(raised.value)


@pytest.mark.parametrize(("overrides", "expected"), [
    ({"truncation_warning": 1.5},
     r"doctor_thresholds\['truncation_warning'\] must be a number in \[0, 1\] \(got 1\.5\)"),
    ({"truncation_error": -0.1}, r"\['truncation_error'\] must be a number in \[0, 1\]"),
    ({"zero_signal_warning": "high"}, r"\['zero_signal_warning'\] must be a number in \[0, 1\] \(got 'high'\)"),
    ({"persistent_steps": 0}, r"\['persistent_steps'\] must be a whole number of steps >= 1 \(got 0\)"),
    ({"recent_steps": 2.5}, r"\['recent_steps'\] must be a whole number of steps >= 1"),
    ({"early_steps": True}, r"\['early_steps'\] must be a whole number of steps >= 1"),
    ({"climb_factor": 0}, r"\['climb_factor'\] must be a number > 0 \(got 0\)"),
    ({"worsened_by": float("inf")}, r"\['worsened_by'\] must be a number > 0"),
    ({"kl_warning": float("nan")}, r"\['kl_warning'\] must be a number >= 0"),
    ({"length_percentile": 101}, r"\['length_percentile'\] must be a number in \[0, 100\]"),
    ({"correctness_names": "correct"}, r"\['correctness_names'\] must be a non-empty list of non-empty strings"),
    ({"correctness_names": []}, r"\['correctness_names'\] must be a non-empty list"),
    ({"truncation_warning": 0.6}, r"truncation_warning \(0\.6\) is above truncation_error \(0\.5\)"),
    (["truncation_warning"], r"doctor_thresholds must be a dict of threshold names to values"),
    ("{truncation_warning: 0.2}", r"doctor_thresholds is not valid JSON"),
])
def test_a_value_of_the_wrong_type_or_range_is_refused_naming_the_key_and_range(overrides, expected):
    with pytest.raises(ValueError, match=expected):
        resolve(overrides)
    with pytest.raises(ValueError, match=expected):  # and by the config, when it is built
        GRPOConfig(doctor_thresholds=overrides)


def test_the_config_field_round_trips_and_is_documented(tmp_path):
    overrides = {"truncation_warning": 0.2, "persistent_steps": 3, "correctness_names": ["score"]}
    config = GRPOConfig(doctor_thresholds=overrides)
    assert config.diff() == {"doctor_thresholds": overrides}
    assert GRPOConfig.from_dict(config.to_dict()) == config
    config.to_yaml(tmp_path / "config.yaml")
    assert GRPOConfig.from_yaml(tmp_path / "config.yaml").doctor_thresholds == overrides
    parsed = GRPOConfig.from_args(["--doctor_thresholds", '{"truncation_warning": 0.2}'])
    assert parsed.doctor_thresholds == {"truncation_warning": 0.2}
    assert GRPOConfig(doctor_thresholds='{"kl_warning": 0.3}').doctor_thresholds == {"kl_warning": 0.3}
    assert GRPOConfig().doctor_thresholds is None
    assert "docs/troubleshooting.md" in GRPOConfig.field_help("doctor_thresholds")
    assert "--doctor_thresholds (default: None)" in GRPOConfig.help_text()


def test_every_threshold_is_listed_once_with_a_known_kind():
    assert len(BY_NAME) == len(TABLE) and all(threshold.kind in KINDS for threshold in TABLE)
    assert all(threshold.name == threshold.name.lower() and threshold.meaning for threshold in TABLE)


def test_thresholds_on_the_command_line_are_asked_for_as_json():
    from grpo_lab import GRPOConfig

    with pytest.raises(ValueError, match=r"--doctor_thresholds: cannot read .* Give it as JSON"):
        GRPOConfig.from_args(["--doctor_thresholds", "truncation_warning=0.5"])
    assert GRPOConfig.from_args(["--doctor_thresholds", '{"truncation_warning": 0.2}']).doctor_thresholds == {
        "truncation_warning": 0.2}
