"""The one prompt builder (node/run/prompts.py): raw prompts for base models, the checkpoint's own chat template
with the run's system prompt for chat models, identical on node and validator, deterministic and bounded.

Everything goes through the real path: checkpoints saved to disk and loaded back with load_run_tasks (what the
node's rollout loop and the validator's checkpoint keeper call), and `prime-node rollout` / `verify`.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from prime_node.node.cli.main import main
from prime_node.node.engine import load_engine
from prime_node.node.environments import DEFAULT_ENV, open_environment
from prime_node.node.environments.difficulty import estimate_pass_rates
from prime_node.node.environments.length import thinking_suffix
from prime_node.node.errors import PromptError
from prime_node.node.models.chat_tokenizer import CHAT_TEMPLATE
from prime_node.node.models.tiny import build_tiny_model, save_model_dir
from prime_node.node.run.chat_template import MAX_STEPS
from prime_node.node.run.prompts import PromptBuilder
from prime_node.node.run.settings import RunSettings, load_run_tasks
from prime_node.node.run.validation import RunTasks
from prime_node.node.runtime.supervisor import Supervisor
from prime_node.p2p.identity import Identity
from prime_node.p2p.processes import end_pids
from prime_node.trainer.devnet.processes import ProcessGroup
from prime_node.trainer.validator.run import start_validator

from support.node_daemon import NODE_ENV, node_argv, operator_fleet
from support.swarm import fleet, wait_until
from support.trainer_service import start_trainer, trainer_argv
from support.validator import (
    OPERATOR,
    RUN,
    announce_run,
    publish_checkpoint,
    rows_for,
    sees_a_validator,
    validator_settings,
    write_file,
)

SYSTEM = "You are a careful assistant. Give the final answer after '='."
TARGETS = [8, 16]
PAIRS = [(index, seed) for index in range(0, 400, 7) for seed in (3, 1 << 40, 2**64 - 1)]
# The raw format's identity: the length instruction and the format version, no template, no system prompt.
RAW_FORMAT = "sha256:b52a746714bbdc85d85b7fbe9c62ec2f6b103f0aeebe5cee7269c8b9d44f1b77"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the default tiny model, the chat model), both untrained: prompts do not depend on the weights."""
    root = tmp_path_factory.mktemp("prompts")
    made = []
    for name, chat in (("tiny", False), ("chat", True)):
        model, tokenizer = build_tiny_model(0, chat=chat)
        save_model_dir(model, tokenizer, root / name)
        made.append(root / name)
    return made[0], made[1]


def _copy_with_template(checkpoint: Path, out: Path, template: str | None) -> Path:
    """A copy of the checkpoint with another chat template in its tokenizer_config.json."""
    shutil.copytree(checkpoint, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if template is not None:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_raw_prompts_of_a_base_model_are_unchanged(checkpoints: tuple[Path, Path]) -> None:
    tiny, _ = checkpoints
    tasks = load_run_tasks(RunSettings(length_targets=TARGETS), tiny)
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    assert tasks.prompts.mode == "raw" and tasks.prompt_format == RAW_FORMAT
    for index, seed in PAIRS:
        target = tasks.target_length(seed)
        # The format of every release before chat models: task text + instruction, no special tokens.
        text = tasks.environment.get(index).prompt + thinking_suffix(target)
        assert tasks.prompt_ids(index, seed) == tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
    without_targets = load_run_tasks(RunSettings(), tiny)
    prompt = without_targets.environment.get(5).prompt
    assert without_targets.prompt_ids(5, 0) == tuple(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert without_targets.prompt_format == RAW_FORMAT


def test_node_and_validator_build_the_same_chat_prompt_ids(
    checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    _, chat = checkpoints
    # The node's and the validator's own copies of the checkpoint, each loaded on its own.
    node_copy, validator_copy = tmp_path / "node", tmp_path / "validator"
    shutil.copytree(chat, node_copy)
    shutil.copytree(chat, validator_copy)
    run = RunSettings(length_targets=TARGETS, system_prompt=SYSTEM)
    node = load_run_tasks(run, node_copy)
    validator = load_run_tasks(run, validator_copy)
    assert node.prompts.mode == "chat" and node.prompt_format == validator.prompt_format != RAW_FORMAT
    tokenizer = AutoTokenizer.from_pretrained(chat)
    for index, seed in PAIRS:
        ids = node.prompt_ids(index, seed)
        assert ids == validator.prompt_ids(index, seed)
        user = node.environment.get(index).prompt + thinking_suffix(node.target_length(seed))
        conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        # The model's own template, as transformers applies it: same text, same ids.
        expected = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        assert expected == (
            f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        )
        assert list(ids) == tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    # A real BPE: the turn markers are single control tokens and words are merged.
    first = node.prompt_ids(0, 3)
    assert first[:2] == tuple(tokenizer.convert_tokens_to_ids(["<|im_start|>", "system"]))
    assert len(first) < len(node.prompts.text(node.environment.get(0).prompt, node.target_length(3))) / 2


def test_another_template_or_system_prompt_gives_another_format_and_other_ids(
    checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    _, chat = checkpoints
    spaced = _copy_with_template(
        chat, tmp_path / "spaced", CHAT_TEMPLATE.replace("'\\n' ~ message", "': ' ~ message")
    )
    variants = {
        "run's": load_run_tasks(RunSettings(system_prompt=SYSTEM), chat),
        "no system prompt": load_run_tasks(RunSettings(), chat),
        "another system prompt": load_run_tasks(RunSettings(system_prompt=SYSTEM + " Be brief."), chat),
        "another template": load_run_tasks(RunSettings(system_prompt=SYSTEM), spaced),
    }
    formats = {name: tasks.prompt_format for name, tasks in variants.items()}
    assert len(set(formats.values())) == len(variants), formats
    for index, seed in PAIRS[:20]:
        ids = {tasks.prompt_ids(index, seed) for tasks in variants.values()}
        assert len(ids) == len(variants)  # every variant's prompt differs from every other's
    # The format is a function of its inputs, not of the object: loading again gives the same one.
    assert load_run_tasks(RunSettings(system_prompt=SYSTEM), chat).prompt_format == formats["run's"]


def test_a_rollout_made_with_another_system_prompt_or_template_is_rejected(
    checkpoints: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, chat = checkpoints
    key = tmp_path / "node.key"
    Identity.from_seed(b"\x44" * 32).save(key)
    out = tmp_path / "batch.parquet"
    run = ["--run-seed", "9", "--samples", "2", "--max-new-tokens", "12", "--length-targets", "8", "16"]
    common = ["--log-level", "WARNING", "--json"]
    argv = ["rollout", "--checkpoint", str(chat), "--key", str(key), "--step", "1", "--out", str(out)]
    assert (
        main([*argv, "--batch-counter", "0", "--prompts", "2", *run, "--system-prompt", SYSTEM, *common]) == 0
    )
    capsys.readouterr()

    def verify(checkpoint: Path, *extra: str) -> dict:
        code = main(["verify", str(out), "--checkpoint", str(checkpoint), *run, *extra, *common])
        captured = capsys.readouterr()
        assert captured.out, captured.err
        report = json.loads(captured.out)
        assert code == (0 if report["accepted"] else 1)
        return report

    assert verify(chat, "--system-prompt", SYSTEM)["accepted"] is True  # the honest control
    for report in (
        verify(chat, "--system-prompt", SYSTEM + " Be brief."),
        verify(chat),
        verify(
            _copy_with_template(chat, tmp_path / "other", CHAT_TEMPLATE.replace("'\\n'", "'\\n\\n'")),
            "--system-prompt",
            SYSTEM,
        ),
    ):
        assert report["accepted"] is False
        # The rows' prompt_format column names the difference first (run-parameters, before any prompt is
        # rebuilt); the prompts check would catch the ids themselves.
        assert report["reasons"][0].startswith("run-parameters: "), report["reasons"]
        assert "another chat template or system prompt" in report["reasons"][0], report["reasons"]


def test_a_system_prompt_without_a_chat_template_stops_at_start_up(
    checkpoints: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny, chat = checkpoints
    with pytest.raises(PromptError, match=r"run\.system_prompt.*has no chat template"):
        load_run_tasks(RunSettings(system_prompt=SYSTEM), tiny)
    key = tmp_path / "node.key"
    Identity.from_seed(b"\x45" * 32).save(key)
    argv = [
        "rollout",
        "--checkpoint",
        str(tiny),
        "--key",
        str(key),
        "--step",
        "1",
        "--out",
        str(tmp_path / "b.parquet"),
    ]
    assert main([*argv, "--system-prompt", SYSTEM]) == 1
    assert "has no chat template" in capsys.readouterr().err
    assert not (tmp_path / "b.parquet").exists()
    assert load_run_tasks(RunSettings(system_prompt=SYSTEM), chat).prompts.mode == "chat"  # the control


LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
BROKEN_TEMPLATES = {
    "raises": ("{{ raise_exception('no system role here') }}", "fails: TemplateError: no system role here"),
    "syntax": ("{% for m in messages %}{{ m.content }}", "does not compile"),
    "undefined call": ("{{ nothing_here() }}{{ messages[0].content }}", "fails: UndefinedError"),
    "loops": (LOOP + CHAT_TEMPLATE, f"ran more than {MAX_STEPS:,} steps"),
    "string bomb": ("{{ 'x' * 10000000000 }}" + CHAT_TEMPLATE, "with '*'"),
    "power bomb": ("{{ 10 ** 100000000 }}" + CHAT_TEMPLATE, "bits with '**'"),
    "doubling": (
        "{% set ns = namespace(s='xy') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
        + CHAT_TEMPLATE,
        "namespace value",
    ),
    "doubling macro": (
        "{% macro grow(s, n) %}{{ grow(s ~ s, n - 1) if n else s|length }}{% endmacro %}{{ grow('ab', 60) }}"
        + CHAT_TEMPLATE,
        "call argument",
    ),
    "random": ("{{ [1, 2]|random }}" + CHAT_TEMPLATE, "No filter named 'random'"),
    "lipsum": ("{{ lipsum(1) }}" + CHAT_TEMPLATE, "fails: UndefinedError"),
    "no generation prompt": (
        CHAT_TEMPLATE.split("{%- if add_generation_prompt")[0],
        "ignores add_generation_prompt",
    ),
    "drops the user": (CHAT_TEMPLATE.replace("~ message['content'] ~", "~"), "leaves the user's text out"),
    "drops the system prompt": (
        CHAT_TEMPLATE.replace(
            "{%- for message in messages -%}",
            "{%- for message in messages if message['role'] != 'system' -%}",
        ),
        "leaves the system prompt out",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN_TEMPLATES))
def test_a_broken_chat_template_stops_at_start_up_with_a_clear_error(
    case: str, checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    _, chat = checkpoints
    template, message = BROKEN_TEMPLATES[case]
    broken = _copy_with_template(chat, tmp_path / "broken", template)
    run = RunSettings(system_prompt=SYSTEM, length_targets=TARGETS)
    started = time.monotonic()
    with pytest.raises(PromptError) as caught:
        load_run_tasks(run, broken)
    elapsed = time.monotonic() - started
    assert message in str(caught.value) and str(broken) in str(caught.value), str(caught.value)
    assert elapsed < 60, f"{case}: {elapsed:.1f} s to refuse"
    # The honest control: the same copy with the model's own template loads.
    good = _copy_with_template(chat, tmp_path / "good", CHAT_TEMPLATE)
    assert load_run_tasks(run, good).prompts.mode == "chat"


def test_a_template_failing_on_one_task_names_it(checkpoints: tuple[Path, Path], tmp_path: Path) -> None:
    _, chat = checkpoints
    picky = (
        "{% if '*' in messages[-1]['content'] %}{{ raise_exception('no products') }}{% endif %}"
        + CHAT_TEMPLATE
    )
    tasks = load_run_tasks(RunSettings(), _copy_with_template(chat, tmp_path / "picky", picky))
    products = [i for i in range(200) if "*" in tasks.environment.get(i).prompt]
    sums = [i for i in range(200) if "*" not in tasks.environment.get(i).prompt]
    assert "*" not in tasks.environment.get(0).prompt and products and sums
    assert tasks.prompt_ids(sums[0], 1)
    with pytest.raises(PromptError, match=rf"task {products[0]}: .*no products"):
        tasks.prompt_ids(products[0], 1)


def test_rendering_is_deterministic_and_reads_no_clock(
    checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    _, chat = checkpoints
    dated = "{{ 'Today: ' ~ strftime_now('%Y-%m-%d') ~ '\\n' }}" + CHAT_TEMPLATE
    tasks = load_run_tasks(
        RunSettings(system_prompt=SYSTEM), _copy_with_template(chat, tmp_path / "dated", dated)
    )
    text = tasks.prompts.text("1+1=", 8)
    assert (
        text.startswith("Today: 1970-01-01\n<|im_start|>system\n") and tasks.prompts.text("1+1=", 8) == text
    )
    # transformers' own apply_chat_template reads the clock: a prompt built before midnight and checked after
    # would differ. The builder's does not, which is why it renders templates itself.
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "dated")
    conversation = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "1+1=" + thinking_suffix(8)},
    ]
    theirs = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert not theirs.startswith("Today: 1970") and theirs.split("\n", 1)[1] == text.split("\n", 1)[1]


# Jinja features real templates use (namespace, loop variables, filters, loop controls, the special tokens,
# whitespace control, the generation tag): rendered exactly as transformers renders them.
FEATURES_TEMPLATE = """{{ eos_token }}
{%- set ns = namespace(system='', count=0) -%}
{%- for m in messages -%}
  {%- if m.role == 'system' -%}{%- set ns.system = m.content -%}{%- continue -%}{%- endif -%}
  {%- set ns.count = ns.count + 1 -%}
{%- endfor %}
{% if ns.system %}[SYS] {{ ns.system | tojson }} ({{ ns.count }} turns)
{% endif %}
{% for m in messages if m.role != 'system' %}
    {% if loop.first %}<first>{% endif %}
{{ m.role | upper }}: {% generation %}{{ m.content | trim }}{% endgeneration %}
    {% if loop.last %}</last>{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}ASSISTANT: {% endif %}"""


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, FEATURES_TEMPLATE], ids=["chat model", "features"])
def test_the_renderer_renders_what_transformers_renders(
    template: str, checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    _, chat = checkpoints
    tokenizer = AutoTokenizer.from_pretrained(_copy_with_template(chat, tmp_path / "t", template))
    for system in ("", SYSTEM, 'Quotes " and ünïcödé \\ stay as they are.'):
        builder = PromptBuilder(tokenizer, system_prompt=system)
        for prompt in ("1+1=", "  (3+4)*5=  ", "What is 17*23?\nAnswer after '='."):
            conversation = [{"role": "system", "content": system}] if system else []
            conversation.append({"role": "user", "content": prompt + thinking_suffix(16)})
            theirs = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
            assert builder.text(prompt, 16) == theirs


def test_run_tasks_built_directly_or_loaded_agree(checkpoints: tuple[Path, Path]) -> None:
    """RunTasks built directly (as benchmarks and the trainer's tests do) uses the same builder."""
    tiny, chat = checkpoints
    for checkpoint in (tiny, chat):
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        direct = RunTasks(open_environment(DEFAULT_ENV), tokenizer, length_targets=TARGETS)
        loaded = load_run_tasks(RunSettings(length_targets=TARGETS), checkpoint)
        assert direct.prompt_format == loaded.prompt_format
        assert [direct.prompt_ids(i, s) for i, s in PAIRS] == [loaded.prompt_ids(i, s) for i, s in PAIRS]


async def test_a_validator_that_cannot_build_the_runs_prompts_stops_instead_of_excusing_every_file(
    tmp_path: Path,
    world,  # noqa: ANN001
) -> None:
    checkpoint, engine, tasks = world  # the tiny model: no chat template
    node = Identity.generate()
    path, envelope = write_file(tmp_path / "r.parquet", rows_for(engine, tasks, node), node)
    settings = validator_settings(tmp_path / "validator")
    settings = settings.model_copy(update={"run": settings.run.model_copy(update={"system_prompt": SYSTEM})})
    publish_checkpoint(checkpoint, settings.resolved_data_dir() / "validator-weights", 0)
    supervisor = Supervisor("test-validator")
    running = await start_validator(settings, OPERATOR, supervisor)
    pids = list(running.swarm.process.pids) if running.swarm.process else []
    try:
        await announce_run(running.swarm, settings.run)
        async with fleet(RUN, OPERATOR) as group:
            sender = await group.add(node, bootstrap=running.maddrs[:1], reachability="public")
            await wait_until(lambda: sees_a_validator(sender), 15)
            await sender.send_rollout(path, envelope)
            with pytest.raises(PromptError, match=r"run\.system_prompt.*has no chat template"):
                await asyncio.wait_for(supervisor.wait(), 60)
        # Stopped before judging: no verdict, neither a rejection nor an excused internal error.
        assert await running.service.ledger.verdict_for(envelope.sha256, node.node_id) is None
    finally:
        report = await supervisor.shutdown(15.0)
        end_pids(pids, 3.0)
    assert report.clean, report


@pytest.mark.slow
async def test_a_node_whose_checkpoint_template_fails_stops_with_the_reason(
    checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    _, chat = checkpoints
    broken = _copy_with_template(chat, tmp_path / "broken", "{{ raise_exception('broken on purpose') }}")
    operator_id = Identity.generate()
    data_dir = tmp_path / "node"
    Identity.generate().save(data_dir / "node.key")
    async with operator_fleet(tmp_path / "operator-store", operator_id) as (_, operator):
        await operator.announce(0, await operator.publish(broken, 0))
        argv = node_argv(data_dir, operator_id.node_id, (await operator.swarm.maddrs())[:1])
        with ProcessGroup(tmp_path / "logs") as procs:
            started = procs.start("node", argv, env=NODE_ENV)
            code = await asyncio.to_thread(started.process.wait, 180)
            log = started.log_path.read_text()
    assert code == 1, log
    assert "prime-node start: error:" in log and "fails: TemplateError: broken on purpose" in log, log
    assert "Traceback" not in log and not list((data_dir / "rollouts").rglob("*.parquet"))


def test_a_trainer_whose_model_cannot_take_the_system_prompt_stops_before_announcing(
    checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    tiny, _ = checkpoints
    key, log = tmp_path / "op.key", tmp_path / "trainer.log"
    Identity.generate().save(key)
    argv = trainer_argv(tiny, key, tmp_path / "data", "--no-dht", "--system-prompt", SYSTEM)
    proc = start_trainer(argv, log)
    try:
        code = proc.wait(120)
    finally:
        end_pids([proc.pid], 3.0)
    text = log.read_text()
    assert code == 1 and "has no chat template" in text and "Traceback" not in text, text
    assert proc.stdout is not None and b'"step"' not in proc.stdout.read()  # never ready, so never announced


class _RecordingEngine:
    """The real engine, noting the prompts it is asked to complete."""

    def __init__(self, engine: object) -> None:
        self.engine, self.prompts = engine, []

    def generate(self, requests, params, capture_hidden):  # noqa: ANN001, ANN201
        self.prompts += [tuple(r.prompt_ids) for r in requests]
        return self.engine.generate(requests, params, capture_hidden=capture_hidden)


def test_difficulty_filtering_asks_the_model_the_runs_prompts(checkpoints: tuple[Path, Path]) -> None:
    for checkpoint in checkpoints:
        engine = _RecordingEngine(load_engine(checkpoint, threads=1))
        tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
        task_set = open_environment(DEFAULT_ENV)
        estimate_pass_rates(engine, tokenizer, task_set, [0, 1, 2], k=2, max_new_tokens=3)
        run = RunTasks(task_set, tokenizer)
        assert engine.prompts == [run.prompt_ids(i, 0) for i in (0, 1, 2) for _ in range(2)]
