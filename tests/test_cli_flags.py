"""Settings flags are declared once: generated from the settings field, loaded by the same declaration.

Each command's parser records its settings flags (node/cli/flags.py); these tests walk every parser of
`prime-node` and hold each flag to its field, then load settings through the real parsers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from prime_node.node.cli.flags import (
    NAMESPACE_KEY,
    Flag,
    SettingsFlags,
    default_of,
    flag_help,
    load_settings,
    resolve,
)
from prime_node.node.cli.main import build_parser
from prime_node.node.config import FlagValueError
from prime_node.node.contributor.settings import StartSettings
from prime_node.p2p.identity import Identity
from prime_node.p2p.swarm import SwarmConfig
from prime_node.trainer.validator.config import ValidatorSettings

PEER = "/ip4/127.0.0.1/tcp/{port}/p2p/12D3KooWF4NCf4BuFF35ra6sCoMwfpNBVSQppG7VzU6yC98XsiB7"


def _parsers(
    parser: argparse.ArgumentParser, path: str = "prime-node"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, f"{path} {name}")


def _field_names(model: type) -> set[str]:
    names = set()
    for name, field in model.model_fields.items():
        names.add(name)
        section = field.annotation
        if isinstance(section, type) and hasattr(section, "model_fields"):
            names |= _field_names(section)
    return names


def test_every_settings_flag_is_its_field_and_no_default_is_written_twice() -> None:
    checked = 0
    for command, parser in _parsers(build_parser()):
        flags = parser.get_default(NAMESPACE_KEY)
        declared = {flag.attr: flag for flag in flags.flags} if isinstance(flags, SettingsFlags) else {}
        for action in parser._actions:
            if not action.option_strings or action.default == argparse.SUPPRESS:
                continue
            flag = declared.get(action.dest)
            if flag is not None:
                field = resolve(flags.model, flag.path)
                # The help is the field's description, with the field's default, bounds and repeatability.
                assert field.description and action.help.startswith(field.description.rstrip(".")), command
                default = default_of(flags.defaults, flag.path)
                assert action.help == flag_help(field, default, repeatable=flag.append), (command, flag)
                # The default lives in the field only: the flag's own default means "not given".
                assert action.default is None, (command, flag)
                checked += 1
                continue
            # A hand-written flag is not a setting of the command (that would be the old FLAGS map again)...
            if isinstance(flags, SettingsFlags) and action.dest != "config":
                assert action.dest not in _field_names(flags.model), (command, action.option_strings)
            # ...and shows its default through argparse, never as a second copy in the help text.
            if action.default not in (None, False) and action.help:
                assert str(action.default) not in action.help.replace("%(default)s", ""), (
                    command,
                    action.help,
                )
    assert checked > 100  # every command's settings flags were seen


def test_help_reads_the_field() -> None:
    start = next(p for name, p in _parsers(build_parser()) if name == "prime-node start")
    helps = {a.option_strings[0]: a.help for a in start._actions if a.option_strings}
    assert helps["--peers"] == SwarmConfig.model_fields["initial_peers"].description
    assert helps["--samples"] == "Completions per prompt (G). Default 4; from 1 to 1024."
    assert (
        helps["--run-seed"] == "Seed of the deterministic work assignment. Default 0; at least 0, below 2^64."
    )
    assert helps["--data-dir"].endswith("Default ~/.prime-node.")


def _start(*argv: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prime_node.node.cli.main", "start", "--data-dir", str(tmp_path), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("PRIME_NODE_")},
    )


def test_a_bad_flag_value_is_one_line_naming_the_flag(tmp_path: Path) -> None:
    # A usage error, as argparse's own (`--samples x`): exit status 2, one line, no traceback.
    for argv, error in [
        (
            ["--peers", "garbage"],
            "argument --peers: 'garbage' is not a multiaddr (Invalid MultiAddr 'garbage': Must begin with /); "
            "e.g. /ip4/203.0.113.7/tcp/31337/p2p/12D3Koo...",
        ),
        (
            ["--peers", "/ip4/1.2.3.4/tcp/1"],
            "argument --peers: initial peer '/ip4/1.2.3.4/tcp/1' lacks its /p2p/<peer id> part; copy the full "
            "address",
        ),
        (
            ["--operator-key", "abc"],
            "argument --operator-key: must be the operator's node id: 64 lowercase hex digits (got 'abc')",
        ),
    ]:
        result = _start(*argv, tmp_path=tmp_path)
        assert (result.returncode, result.stderr.splitlines()) == (2, [f"prime-node start: error: {error}"])
    # The honest control: the same flags with good values load into the settings they name.
    operator = Identity.generate().node_id
    args = build_parser().parse_args(
        ["start", "--data-dir", str(tmp_path), "--peers", PEER.format(port=1), "--operator-key", operator]
    )
    settings = load_settings(args, StartSettings)
    assert (settings.swarm.initial_peers, settings.operator_key) == ([PEER.format(port=1)], operator)


def test_flags_win_over_the_environment_over_the_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [k for k in os.environ if k.startswith("PRIME_NODE_")]:
        monkeypatch.delenv(name)
    toml = tmp_path / "node.toml"
    toml.write_text(
        f'[swarm]\ninitial_peers = ["{PEER.format(port=1)}"]\n[run]\nsamples = 3\ntask_seed = 7\n'
    )
    monkeypatch.setenv("PRIME_NODE_SWARM__INITIAL_PEERS", json.dumps([PEER.format(port=2)]))
    monkeypatch.setenv("PRIME_NODE_RUN__SAMPLES", "5")
    parser = build_parser()

    def start(*flags: str) -> StartSettings:
        return load_settings(parser.parse_args(["start", "--config", str(toml), *flags]), StartSettings)

    settings = start()
    assert (settings.swarm.initial_peers, settings.run.samples) == ([PEER.format(port=2)], 5)
    assert (settings.run.task_seed, settings.run.run_seed) == (7, 0)  # the file's, the field's default
    settings = start("--peers", PEER.format(port=3), "--samples", "6")
    assert (settings.swarm.initial_peers, settings.run.samples) == ([PEER.format(port=3)], 6)

    # The validator's --run-id names the DHT's run too, over the file's swarm.run_id.
    toml.write_text('[swarm]\nrun_id = "dht-of-the-file"\n')
    validator = ["validator", "--key", str(tmp_path / "k"), "--config", str(toml)]
    assert load_settings(parser.parse_args(validator), ValidatorSettings).swarm.run_id == "dht-of-the-file"
    given = load_settings(parser.parse_args([*validator, "--run-id", "r2"]), ValidatorSettings)
    assert (given.run.run_id, given.swarm.run_id) == ("r2", "r2")


class _Section(BaseModel):
    peers: list[str] = Field(default_factory=list, description="Peers.")
    quiet: bool = Field(True, description="On unless turned off.")
    bare: int = 0


class _Settings(BaseModel):  # no CommonSettings: loading them would configure logging
    section: _Section = Field(default_factory=_Section, description="A section.")
    port: int = Field(8470, ge=0, le=65535, description="A port.")


def test_a_flag_the_field_cannot_carry_is_refused_when_the_parser_is_built() -> None:
    def add(flag: Flag) -> None:
        SettingsFlags(argparse.ArgumentParser(), _Settings).add(flag)

    for flag, error in [
        (Flag("section.missing"), "_Section has no field 'missing'"),
        (Flag("port.section"), "'port' is not a section"),
        (Flag("section.bare"), "has no description"),
        (Flag("section.quiet"), "defaults to true"),
        (Flag("port", nargs="+"), "is not a list"),
        (Flag("section.peers", nargs="+", append=True), "one value per use"),
        (Flag("port", dest=NAMESPACE_KEY), "is taken"),
    ]:
        with pytest.raises(ValueError, match=error):
            add(flag)
    # The honest control: the same fields declared as they can be.
    parser = argparse.ArgumentParser()
    flags = SettingsFlags(parser, _Settings)
    flags.add(Flag("section.peers", "--peer", append=True), Flag("port"))
    settings = flags.load(parser.parse_args(["--peer", "a", "--peer", "b", "--port", "1"]))
    assert (settings.section.peers, settings.port) == (["a", "b"], 1)
    with pytest.raises(FlagValueError, match=r"^argument --port: .* \(got 70000\)$"):
        flags.load(parser.parse_args(["--port", "70000"]))
