"""The `prime-node` command itself: help lists only real commands; keygen/identity; one-line errors."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

from prime_node.node.cli.main import COMMAND_MODULES, build_parser, main


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "prime_node.node.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_help_lists_exactly_the_registered_commands():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    names = set(sub.choices)
    assert {"keygen", "identity"} <= names
    for name, subparser in sub.choices.items():
        assert subparser.get_default("handler") is not None, f"{name} has no handler"
    assert len(COMMAND_MODULES) == len(set(COMMAND_MODULES))


def test_keygen_then_identity(tmp_path, capsys):
    assert main(["keygen", "--data-dir", str(tmp_path), "--json"]) == 0
    made = json.loads(capsys.readouterr().out)
    key = tmp_path / "node.key"
    assert made["key_file"] == str(key) and stat.S_IMODE(key.stat().st_mode) == 0o600
    assert main(["identity", "--data-dir", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["node_id"] == made["node_id"]


def test_errors_are_one_clear_line_with_nonzero_exit(tmp_path):
    out = tmp_path / "k.key"
    assert _run("keygen", "--out", str(out)).returncode == 0
    again = _run("keygen", "--out", str(out))
    assert again.returncode == 1
    assert again.stderr.strip().splitlines() == [
        f"prime-node keygen: error: {out} already exists; pass --force to overwrite it (the old key is lost)"
    ]
    out.chmod(0o644)
    unsafe = _run("identity", "--key", str(out))
    assert unsafe.returncode == 1 and "chmod 600" in unsafe.stderr and "Traceback" not in unsafe.stderr
    bad_env = _run("identity", "--key", str(out), env={"PRIME_NODE_LOG_LEVEL": "LOUD"})
    assert bad_env.returncode == 1 and "PRIME_NODE_LOG_LEVEL" in bad_env.stderr


def test_unknown_command_is_a_usage_error():
    result = _run("frobnicate")
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_building_the_cli_does_not_import_torch():
    """Every command (status, keygen, weights...) must start fast: torch, transformers and hivemind load only in
    commands that run a model or join the swarm, though every parser builds its flags from the settings models."""
    probe = (
        "import sys; from prime_node.node.cli.main import build_parser; build_parser(); "
        "print(sorted({'torch', 'transformers', 'hivemind'} & {name.split('.')[0] for name in sys.modules}))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
