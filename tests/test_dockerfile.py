"""The Dockerfile, checked without a Docker engine (there is none on these machines, so it is never built here).

What can be checked from its text is: it runs as an unprivileged user, keeps the data directory on its
volume, declares a health check that asks the contributor's status API, exposes exactly the ports its
settings bind (all interfaces inside the container, 127.0.0.1 outside it), and sets only variables that
some command reads. The settings are loaded through the real configuration code with the image's
environment, so a misspelt variable (which prime-node would ignore) fails here. The Docker example of
docs/deploy.md is run as far as a machine without Docker and CUDA allows: its `keygen` for real, its `start`
through the parser, the settings and the node's preflight checks.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from prime_node.node.cli.flags import NAMESPACE_KEY, resolve
from prime_node.node.cli.main import build_parser
from prime_node.node.config import CommonSettings, load_config
from prime_node.node.contributor.daemon import ContributorNode
from prime_node.node.contributor.settings import StartSettings
from prime_node.node.errors import NodeError
from prime_node.p2p.swarm.reachability import tcp_ports
from prime_node.trainer.service.config import TrainerCommandSettings
from prime_node.trainer.validator.config import ValidatorSettings

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
GUIDE = ROOT / "docs" / "deploy.md"
COMMANDS: tuple[type[BaseModel], ...] = (StartSettings, TrainerCommandSettings, ValidatorSettings)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile: continuation lines joined, comments dropped."""
    found, current = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not current):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        word, _, rest = current.partition(" ")
        found.append((word.upper(), rest.strip()))
        current = ""
    return found


def dockerfile() -> list[tuple[str, str]]:
    return instructions(DOCKERFILE.read_text())


def image_env(steps: list[tuple[str, str]]) -> dict[str, str]:
    """The PRIME_NODE_* variables the image sets (ENV K=V ..., quotes removed as Docker removes them)."""
    env = {}
    for word, args in steps:
        if word == "ENV":
            for item in shlex.split(args):
                name, sep, value = item.partition("=")
                assert sep, f"ENV {args!r}: use the KEY=VALUE form"
                if name.startswith("PRIME_NODE_"):
                    env[name] = value
    return env


def load(model: type[BaseModel], env: dict[str, str]) -> Any:
    return load_config(model, env=env)  # type: ignore[type-var]


def test_the_image_runs_as_an_unprivileged_user_with_its_data_on_the_volume() -> None:
    steps = dockerfile()
    words = [w for w, _ in steps]
    users = [args for w, args in steps if w == "USER"]
    assert users and users[-1] not in ("root", "0") and not users[-1].startswith("0:"), users
    user = users[-1]
    creates = [args for w, args in steps if w == "RUN" and re.search(rf"useradd\b.*\b{user}\b", args)]
    assert creates, f"no RUN creates the user {user!r}"
    # Everything after USER runs as it: the health check and the entrypoint included.
    assert words.index("USER") < words.index("HEALTHCHECK") and words.index("USER") < words.index(
        "ENTRYPOINT"
    )

    (volume,) = [json.loads(args) for w, args in steps if w == "VOLUME"]
    env = image_env(steps)
    assert CommonSettings.model_validate({}).resolved_data_dir() != Path("/data")
    assert load(CommonSettings, env).resolved_data_dir() == Path(volume[0])
    # The volume's directory belongs to the user, and is made so before VOLUME (later changes are discarded).
    chown = [
        i for i, (w, args) in enumerate(steps) if w == "RUN" and f"chown {user}:{user} {volume[0]}" in args
    ]
    assert chown and chown[0] < words.index("VOLUME"), "the data directory is not the user's"


def test_the_image_copies_everything_its_pip_install_reads() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = {"pyproject.toml", project["project"]["readme"], "LICENSE"}
    needed |= set(project["tool"]["setuptools"]["package-dir"].values())
    copied = set()
    for word, args in dockerfile():
        if word == "COPY":
            *sources, _ = args.split()
            copied |= set(sources)
    assert needed <= copied, f"not copied into the image: {sorted(needed - copied)}"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not needed & set(ignored)


def test_servers_bind_all_interfaces_in_the_image_and_loopback_outside_it() -> None:
    steps = dockerfile()
    env = image_env(steps)
    start, trainer, validator = (load(model, env) for model in COMMANDS)
    binds = {
        "contributor status API and /metrics": (start.status_host, start.status_port),
        "weights server": (trainer.serve.host, trainer.serve.port),
        "trainer /metrics": (trainer.service.metrics_host, trainer.service.metrics_port),
        "validator API and dashboard": (validator.dashboard.host, validator.dashboard.port),
    }
    for what, (host, port) in binds.items():
        assert host == "0.0.0.0" and port, f"{what} binds {host}:{port} in the image"
    dht = {port for settings in (start, trainer, validator) for port in tcp_ports(settings.swarm.host_maddrs)}
    assert len(dht) == 1 and start.swarm.host_maddrs[0].startswith("/ip4/0.0.0.0/"), dht
    ports = dht | {port for _, port in binds.values()}

    exposed = {int(p.split("/")[0]) for w, args in steps if w == "EXPOSE" for p in args.split()}
    assert exposed == ports, f"EXPOSE {sorted(exposed)} but the image binds {sorted(ports)}"
    docker_section = GUIDE.read_text().split("## Docker", 1)[1]
    documented = {int(p) for p in re.findall(r"^\| (\d+) \|", docker_section, re.M)}
    assert documented == ports, f"docs/deploy.md's Docker table lists {sorted(documented)}"

    # Outside a container nothing is exposed unless the operator says so.
    start, trainer, validator = (load(model, {}) for model in COMMANDS)
    for host in (
        start.status_host,
        trainer.serve.host,
        trainer.service.metrics_host,
        validator.dashboard.host,
    ):
        assert host == "127.0.0.1"

    # Every variable the image sets names a setting of some command (prime-node ignores one that does not).
    for name in env:
        path = name.removeprefix("PRIME_NODE_").lower().replace("__", ".")
        assert any(_has(model, path) for model in COMMANDS), f"{name}: no command has the setting {path}"


def _has(model: type[BaseModel], path: str) -> bool:
    try:
        resolve(model, path)
    except ValueError:
        return False
    return True


def test_the_health_check_asks_the_status_api_and_fails_without_a_node(tmp_path: Path) -> None:
    steps = dockerfile()
    (health,) = [args for w, args in steps if w == "HEALTHCHECK"]
    options, _, command = health.partition(" CMD ")
    argv = json.loads(command)
    assert argv[:2] == ["prime-node", "status"], argv
    assert "--start-period=" in options and "--timeout=" in options
    # Run as Docker would, with the image's settings (its data directory here a fresh one): no node, exit 1.
    env = {**os.environ, **image_env(steps), "PRIME_NODE_DATA_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "prime_node.node.cli.main", *argv[1:]],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "no node is running" in done.stderr, done.stderr


def docker_runs(text: str) -> list[list[str]]:
    """The prime-node argument lists of the `docker run` commands in the guide's Docker section."""
    section = text.split("## Docker", 1)[1]
    runs = []
    for body in section.split("```bash\n")[1:]:
        for line in body.split("```", 1)[0].replace("\\\n", " ").splitlines():
            words = shlex.split(line)
            if words[:2] != ["docker", "run"]:
                continue
            rest = words[2:]
            while rest[0].startswith("-"):
                option = rest.pop(0)
                if option not in ("--rm", "-d", "-i", "-t", "-it") and "=" not in option:
                    rest.pop(0)  # its value
            image, *argv = rest
            assert image == "prime-node", (
                f"docker run of image {image!r}; `docker build -t prime-node .` makes"
            )
            runs.append(argv)
    return runs


def test_the_documented_docker_example_starts_a_contributor_with_an_operator_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {**image_env(dockerfile()), "PRIME_NODE_DATA_DIR": str(tmp_path / "data")}
    sheet = {
        "OPERATOR_KEY": "ab" * 32,
        "RUN_ID": "my-run-1",
        "TRAINER_PEER": "/ip4/203.0.113.10/tcp/31337/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN",
        "VALIDATOR_PEER": "/ip4/203.0.113.20/tcp/31338/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN",
    }
    text = re.sub(r"\$\{?([A-Z_]+)\}?", lambda m: sheet.get(m[1], m[0]), GUIDE.read_text())
    runs = docker_runs(text)
    assert [argv[0] for argv in runs] == ["keygen", "start"], runs
    keygen, start = runs
    made = subprocess.run(
        [sys.executable, "-m", "prime_node.node.cli.main", *keygen],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "data" / "node.key").stat().st_mode & 0o077 == 0

    for name, value in env.items():
        monkeypatch.setenv(name, value)

    def preflight(argv: list[str]) -> None:
        args = build_parser().parse_args(argv)
        settings = getattr(args, NAMESPACE_KEY).load(args)
        # --gpu is the example's; the CUDA check is the only one this machine cannot pass.
        ContributorNode(settings, gpu=False).preflight()

    preflight(start)
    # The control: the example this Dockerfile used to give (no operator key) does not start.
    with pytest.raises(NodeError, match="no operator key"):
        preflight(["start", "--gpu", "--data-dir", str(tmp_path / "data")])
