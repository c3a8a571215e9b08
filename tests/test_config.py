"""Typed configuration: precedence flags > environment > TOML > defaults, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import Field

from prime_node.node.config import CommonSettings, Section, load_config
from prime_node.node.errors import ConfigError


class _Engine(Section):
    threads: int = Field(2, ge=1, le=256, description="CPU threads.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")


class _Settings(CommonSettings):
    peers: list[str] = Field(default_factory=list, description="Initial peers.")
    engine: _Engine = Field(default_factory=_Engine, description="Engine section.")


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "prime-node.toml"
    path.write_text(text)
    return path


def test_defaults():
    s = load_config(_Settings, env={})
    assert s.engine.threads == 2 and s.peers == [] and s.data_dir == Path("~/.prime-node")


def test_precedence_flag_over_env_over_toml(tmp_path):
    toml = _toml(tmp_path, 'log_level = "DEBUG"\npeers = ["/ip4/127.0.0.1/tcp/1"]\n[engine]\nthreads = 3\n')
    s = load_config(_Settings, toml_path=toml, env={})
    assert (s.engine.threads, s.log_level, s.peers) == (3, "DEBUG", ["/ip4/127.0.0.1/tcp/1"])
    env = {"PRIME_NODE_ENGINE__THREADS": "5", "PRIME_NODE_PEERS": '["/ip4/127.0.0.1/tcp/2"]'}
    s = load_config(_Settings, toml_path=toml, env=env)
    assert (s.engine.threads, s.log_level, s.peers) == (5, "DEBUG", ["/ip4/127.0.0.1/tcp/2"])
    s = load_config(
        _Settings, toml_path=toml, env=env, cli_overrides={"engine.threads": 7, "log_level": None}
    )
    assert (s.engine.threads, s.log_level) == (7, "DEBUG")  # None means "flag not given"


def test_out_of_range_value_names_field_value_and_source(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(_Settings, env={"PRIME_NODE_ENGINE__THREADS": "0"})
    text = str(err.value)
    assert "'engine.threads'" in text and "greater than or equal to 1" in text
    assert "'0'" in text and "PRIME_NODE_ENGINE__THREADS" in text
    toml = _toml(tmp_path, "[engine]\ntemperature = -1.0\n")
    with pytest.raises(ConfigError, match=r"engine.temperature.*greater than 0.*config file"):
        load_config(_Settings, toml_path=toml, env={})
    # A flag's value is named by the flag (without the flag's own name, as --<field name>).
    with pytest.raises(ConfigError, match=r"^argument --threads: .*less than or equal to 256 \(got 1000\)$"):
        load_config(_Settings, env={}, cli_overrides={"engine.threads": 1000})


def test_unknown_keys_are_errors_not_silently_ignored(tmp_path):
    toml = _toml(tmp_path, "[engine]\nthread = 4\n")
    with pytest.raises(ConfigError, match=r"unknown setting 'engine.thread'.*config file"):
        load_config(_Settings, toml_path=toml, env={})


def test_bad_and_missing_toml_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(_Settings, toml_path=tmp_path / "nope.toml", env={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(_Settings, toml_path=_toml(tmp_path, "engine = [\n"), env={})


def test_environment_of_other_commands_is_ignored():
    s = load_config(_Settings, env={"PRIME_NODE_SOMETHING_ELSE": "x", "HOME": "/root"})
    assert s.engine.threads == 2
