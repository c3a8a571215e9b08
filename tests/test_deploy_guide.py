"""docs/deploy.md, followed literally: a trainer, a validator and a contributor as separate "machines".

Each machine is a home directory of its own on 127.0.0.1 (its own `~/.prime-node`), every command is the
guide's own shell block run there (tests/support/deploy_guide.py), and the only values the test chooses are
those of the guide's run sheet: 127.0.0.1 for the public addresses, free ports, a local folder as the shared
one. It puts an untrained tiny model and a task file of built-in problems where the guide says the operator's
own go (step 2; the guide's rehearsal lines would spend minutes making them). It passes when a contributor's
`prime-node status` shows accepted files, the validator credits that node, and the guide's stop commands end
every process the guide started. The fast tests hold every `prime-node` command line of the guide (those the
slow test cannot run included: Docker) to the real command-line parser.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import socket
from pathlib import Path

import pytest

from prime_node.node.cli.flags import NAMESPACE_KEY
from prime_node.node.cli.main import build_parser
from prime_node.node.environments import DEFAULT_ENV, open_environment
from prime_node.node.errors import NodeError
from prime_node.node.models.tiny import build_tiny_model, save_model_dir
from prime_node.p2p.identity import Identity

from support.deploy_guide import GUIDE, Block, GuideRun, blocks, is_placeholder, sheet_values

# Sample values for the run sheet's placeholders, when a command line is only parsed.
SAMPLE = {
    "OPERATOR_KEY": "ab" * 32,
    "TASKS_SHA256": "cd" * 32,
    "TRAINER_PEER": "/ip4/203.0.113.10/tcp/31337/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN",
    "VALIDATOR_PEER": "/ip4/203.0.113.20/tcp/31338/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN",
}
SHELL_OPERATORS = {"|", "||", "&", "&&", ";", ">", ">>", "<", "2>", ")", "("}


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def expand(text: str, values: dict[str, str]) -> str:
    """`$NAME` and `${NAME}` of the run sheet replaced by `values` (others, such as $HOME, left as written)."""
    return re.sub(r"\$\{?([A-Z][A-Z0-9_]*)\}?", lambda m: values.get(m[1], m[0]), text)


def guide_commands() -> list[list[str]]:
    """Every `prime-node` command line in the guide's shell blocks (marked or not), run-sheet variables
    expanded with the sheet's own values (placeholders with samples), `~` left as written."""
    values: dict[str, str] = {}
    for name, value in sheet_values(_sheet()).items():  # in order: TASKS_URL uses TRAINER_IP
        values[name] = SAMPLE[name] if is_placeholder(value) else expand(value.strip('"'), values)
    subcommands = set(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    commands = []
    for body in GUIDE.read_text().split("```bash\n")[1:]:
        script = body.split("```", 1)[0].replace("\\\n", " ")
        for line in script.splitlines():
            lexer = shlex.shlex(expand(line.split(" #", 1)[0], values), posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            words = list(lexer)
            for i, word in enumerate(words[:-1]):
                if word == "prime-node" and words[i + 1] in subcommands:
                    rest = words[i + 1 :]
                    end = next((j for j, w in enumerate(rest) if w in SHELL_OPERATORS), len(rest))
                    commands.append(rest[:end])
    return commands


def _sheet():
    (sheet,) = [b for b in blocks() if b.sheet]
    return sheet


def test_every_prime_node_command_in_the_guide_parses() -> None:
    commands = guide_commands()
    seen = {c[0] for c in commands}
    assert {"keygen", "trainer", "validator", "start", "status", "leaderboard"} <= seen, seen
    parser = build_parser()
    for argv in commands:
        try:
            args = parser.parse_args(argv)
            flags = getattr(args, NAMESPACE_KEY, None)
            if flags is not None:
                flags.load(args)  # every value checked as the command checks it (addresses, keys, ranges)
        except (SystemExit, NodeError) as exc:  # a refused flag or value: one line on stderr
            raise AssertionError(
                f"docs/deploy.md: `prime-node {shlex.join(argv)}` is refused: {exc}"
            ) from exc


def test_the_guide_marks_its_blocks_and_its_run_sheet_names_what_they_print() -> None:
    found = blocks()
    machines = {b.on for b in found if b.on}
    assert machines == {"trainer", "validator", "contributor"}
    sheet = sheet_values(_sheet())
    assert {b.prints for b in found if b.prints} == {k for k, v in sheet.items() if is_placeholder(v)}
    assert [b.on for b in found if b.stop] == ["contributor", "validator", "trainer"]  # reverse of start
    with pytest.raises(ValueError, match="not run-sheet variables"):
        GuideRun(Path("/nonexistent"), values={"PRIME_NODE_SWARM__POLICY_POLL_S": "0.5"})


@pytest.mark.slow
@pytest.mark.timeout(900)  # about 2 minutes on 2 idle cores; the bound is for a loaded machine
def test_the_deploy_guide_followed_literally_gets_work_accepted(tmp_path: Path) -> None:
    missing = [tool for tool in ("bash", "curl", "sha256sum", "timeout", "python3") if not shutil.which(tool)]
    if missing:
        pytest.skip(f"the guide's commands need {missing}")
    dht_t, dht_v, weights, api, files = free_ports(5)
    guide = GuideRun(
        tmp_path / "machines",
        values={
            "TRAINER_IP": "127.0.0.1",
            "VALIDATOR_IP": "127.0.0.1",
            "TRAINER_DHT_PORT": str(dht_t),
            "VALIDATOR_DHT_PORT": str(dht_v),
            "WEIGHTS_PORT": str(weights),
            "API_PORT": str(api),
            "FILES_PORT": str(files),
            "ACCEPTED_DIR": str(tmp_path / "shared" / "accepted"),
        },
    )
    # The operator's own model and task file, where step 2 says they go.
    run_dir = guide.home("trainer") / "run"
    model, tokenizer = build_tiny_model(0)
    save_model_dir(model, tokenizer, run_dir / "model")
    builtin = open_environment(DEFAULT_ENV)
    rows = [builtin.get(i).model_dump() for i in range(64)]
    (run_dir / "tasks.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

    try:
        for block in guide.all:
            if block.sheet or block.stop:
                continue
            if block.until is not None:
                status = guide.run_until(block, deadline_s=420)
            else:
                guide.run(block)
        assert "(verified)" in status.stdout, status.stdout
        # The trainer announced the public weights URL the guide gave it, at the announced address.
        ready = json.loads((guide.home("trainer") / "trainer.ready").read_text())
        assert ready["sources"] == [f"http://127.0.0.1:{weights}"]
        assert ready["maddrs"][0].startswith(f"/ip4/127.0.0.1/tcp/{dht_t}/p2p/"), ready
        vready = json.loads((guide.home("validator") / "validator.ready").read_text())
        assert vready["maddrs"][0].startswith(f"/ip4/127.0.0.1/tcp/{dht_v}/p2p/"), vready
        # The validator credits the contributor's own key (the one step 7 made) with accepted work.
        contributor = Identity.load(guide.home("contributor") / ".prime-node" / "node.key").node_id
        leaderboard = 'prime-node leaderboard --json --validator "http://$VALIDATOR_IP:$API_PORT"\n'
        board = guide.run(Block(leaderboard, on="contributor"))
        (row,) = json.loads(board.stdout)["nodes"]
        assert row["node_id"] == contributor and row["accepted_files"] >= 1, row
        # The guide's stop commands end everything it started (graceful: SIGTERM).
        for block in [b for b in guide.all if b.stop]:
            guide.run(block)
        left = guide.wait_all_gone(90)
        assert not left, f"still running after the guide's stop commands: {left}"
    finally:
        print(guide.timeline())
        guide.kill_all()
