"""The typed configuration: defaults <- YAML file <- environment <- explicit overrides."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from adaflash.config import ConfigError, LearnerOverrides, Settings, load_config


def test_file_then_environment_then_overrides(tmp_path, monkeypatch):
    cfg = tmp_path / "adaflash.yaml"
    cfg.write_text("learner:\n  alpha: 0.5\n  delta: 0.2\ndataplane:\n  port: 9001\n")
    monkeypatch.setenv("ADAFLASH_LEARNER__DELTA", "0.3")
    s = load_config(cfg, dataplane={"port": 9002})
    assert s.learner.alpha == 0.5  # file over default
    assert s.learner.delta == 0.3  # environment over file
    assert s.dataplane.port == 9002  # explicit over all
    assert load_config().learner.alpha == 0.8  # the file is not remembered


def test_bad_files_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("learner: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    flat = tmp_path / "flat.yaml"
    flat.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(flat)


def test_learner_overrides_are_typed_learner_fields(tmp_path):
    cfg = tmp_path / "adaflash.yaml"
    cfg.write_text("stack:\n  learner_overrides:\n    buffer_size: 8\n")
    s = load_config(cfg)
    assert isinstance(s.stack.learner_overrides, LearnerOverrides)
    assert s.stack.learner_overrides.model_dump(exclude_unset=True) == {"buffer_size": 8}
    assert load_config().stack.learner_overrides.model_dump(exclude_unset=True) == {
        "buffer_size": 16, "anchors_per_record": 4, "max_wait_s": 45.0}
    with pytest.raises(ValidationError, match="nope"):
        Settings(stack={"learner_overrides": {"nope": 1}})
    with pytest.raises(ValidationError, match="buffer_size"):
        Settings(stack={"learner_overrides": {"buffer_size": "many"}})


def test_offline_training_settings_are_one_section(monkeypatch):
    from learner.offline import TrainConfig

    monkeypatch.setenv("ADAFLASH_OFFLINE__STEPS", "12")
    s = load_config()
    assert s.offline.steps == 12 and isinstance(s.offline, TrainConfig)
