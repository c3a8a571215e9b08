"""The weights URL a trainer announces: one peers on other machines can dial, or a refusal at start-up.

A server bound to every interface knows itself as http://0.0.0.0:PORT. Announced as such, every contributor
and validator would fail to download each checkpoint, and nothing would say why. The trainer announces the
operator's `--public-weights-url`, else its bound URL with 0.0.0.0 replaced by the IP of `--announce-maddrs`,
and stops at once, with one line naming both flags, when it has neither.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from prime_node.node.models.tiny import build_tiny_model, save_model_dir
from prime_node.p2p.identity import Identity
from prime_node.p2p.urls import loopback_behind
from prime_node.trainer.errors import TrainerError
from prime_node.trainer.service.config import TrainerCommandSettings
from prime_node.trainer.service.service import weights_sources

PUBLIC_MADDR = "/ip4/203.0.113.10/tcp/31337"


def settings(**sections: dict) -> TrainerCommandSettings:
    return TrainerCommandSettings.model_validate(sections)


def test_the_announced_weights_url_is_one_peers_can_dial(caplog: pytest.LogCaptureFixture) -> None:
    # The operator's public URL wins; a server behind a proxy or NAT is announced as told.
    told = settings(
        service={"public_sources": ["https://weights.example:443"]}, swarm={"announce_maddrs": []}
    )
    assert weights_sources(told, "http://0.0.0.0:8470") == ["https://weights.example:443"]
    # Bound to every interface: the IP peers are told to dial for the DHT.
    announced = settings(swarm={"announce_maddrs": [PUBLIC_MADDR]})
    assert weights_sources(announced, "http://0.0.0.0:8470") == ["http://203.0.113.10:8470"]
    # Bound to one address (the default 127.0.0.1: a devnet on one machine): that address, as before.
    assert weights_sources(settings(), "http://127.0.0.1:8470") == ["http://127.0.0.1:8470"]
    # Left on 127.0.0.1 while a public address is announced: kept (a proxy may forward), but said out loud.
    with caplog.at_level(logging.WARNING, logger="prime_node.trainer.service.service"):
        assert weights_sources(announced, "http://127.0.0.1:8470") == ["http://127.0.0.1:8470"]
    assert "--http-host 0.0.0.0" in caplog.text and PUBLIC_MADDR in caplog.text
    assert loopback_behind("http://127.0.0.1:8471", ["/ip4/127.0.0.1/tcp/1", PUBLIC_MADDR]) == PUBLIC_MADDR
    assert loopback_behind("http://0.0.0.0:8471", [PUBLIC_MADDR]) is None
    assert loopback_behind("http://127.0.0.1:8471", ["/ip4/127.0.0.1/tcp/1"]) is None
    # Without the DHT nothing is announced: the bound URL is only shown.
    assert weights_sources(settings(service={"dht": False}), "http://0.0.0.0:8470") == ["http://0.0.0.0:8470"]
    # Bound to every interface and told nothing: refused, naming what to give.
    with pytest.raises(TrainerError, match="--public-weights-url .* --announce-maddrs"):
        weights_sources(settings(), "http://0.0.0.0:8470")


def test_a_trainer_that_would_announce_0000_stops_with_one_line(tmp_path: Path) -> None:
    model, tokenizer = build_tiny_model(0)
    save_model_dir(model, tokenizer, tmp_path / "model")
    Identity.generate().save(tmp_path / "operator.key")
    argv = [
        *(sys.executable, "-m", "prime_node.node.cli.main", "trainer"),
        *("--model", str(tmp_path / "model"), "--key", str(tmp_path / "operator.key")),
        *("--data-dir", str(tmp_path / "data"), "--http-host", "0.0.0.0", "--log-level", "WARNING"),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines()[-1].startswith(
        "prime-node trainer: error: the weights server binds every interface (http://0.0.0.0:8470)"
    ), done.stderr
    assert not (tmp_path / "data" / "weights").exists()  # refused before publishing anything
