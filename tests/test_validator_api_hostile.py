"""`prime-node leaderboard` against a hostile validator API (tests/support/hostile_validator.py, its own process).

Whatever answers `--validator URL` (plain HTTP: a wrong server, or anyone on the path), the command ends within
its deadline (`timeout_s`, here 1 s, however the bytes are dripped) with exit code 1 and exactly one printable
line on stderr naming what was wrong, and prints nothing else: no traceback (a ban ending in 1e300 once raised
OverflowError in the date formatting), no stall (urllib's timeout was per read, so a body dripped a byte at a
time never timed out), no control character on the terminal (one in a hardware name was printed as is). The
same server's honest mode, asked in the same test, is shown in full.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from prime_node.node.cli.main import main

from support.hostile_validator import MODES, NODE, NODE_ONLY, hostile_validator

TIMEOUT_S = 1.0
SLACK_S = 2.5  # process scheduling on 2 loaded cores; the point is seconds, not the drip's minutes


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with hostile_validator(interval=0.2) as url:
        yield url


@pytest.fixture(autouse=True)
def _settings(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    monkeypatch.setenv("PRIME_NODE_TIMEOUT_S", str(TIMEOUT_S))
    monkeypatch.setenv("PRIME_NODE_DATA_DIR", str(tmp_path))


def _leaderboard(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str, float]:
    capsys.readouterr()
    started = time.monotonic()
    code = main(["leaderboard", *args])
    elapsed = time.monotonic() - started
    out, err = capsys.readouterr()
    return code, out, err, elapsed


@pytest.mark.parametrize("mode", MODES)
def test_a_hostile_validator_costs_one_error_line_within_the_deadline(
    server: str, mode: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The honest control, from the same server: the table and one node's details, in full.
    code, out, err, _ = _leaderboard(capsys, "--validator", f"{server}/honest")
    assert code == 0 and err == "", err
    assert out.splitlines()[1].split()[:3] == ["1", NODE[:12], "5000"] and "until 2027-01-15" in out, out
    code, out, err, _ = _leaderboard(capsys, "--validator", f"{server}/honest", "--node", NODE[:8])
    assert code == 0 and "rejected: sampling: row 0" in out and "gpu_model=NVIDIA H100" in out, out

    asks = [["--node", NODE[:8]]] if mode in NODE_ONLY else [[], ["--node", NODE[:8]], ["--json"]]
    for extra in asks:
        code, out, err, elapsed = _leaderboard(capsys, "--validator", f"{server}/{mode}", *extra)
        if (
            "--json" in extra
        ):  # a --json error is also a JSON object on stdout, for scripts (docs/configuration.md)
            answer = json.loads(out)
            assert code == 1 and answer["exit_code"] == 1 and answer["command"] == "leaderboard", (mode, out)
            assert err.strip().endswith(answer["error"]) and answer["error"].isprintable(), (mode, out, err)
        else:
            assert code == 1 and out == "", (mode, extra, code, out, err)
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("prime-node leaderboard: error: "), (mode, extra, err)
        assert lines[0].isprintable() and "Traceback" not in err, (mode, extra, err)
        assert elapsed < TIMEOUT_S + SLACK_S, (mode, extra, elapsed, err)
