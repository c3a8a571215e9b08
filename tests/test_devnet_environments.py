"""`prime-node devnet --env` end to end on real environments: three reasoning-gym families and a code task file.

For each, a real trainer, validator, two honest contributors and a cheater (inflated rewards) as processes on
127.0.0.1, until one policy step is trained: the honest files are accepted, the cheater is slashed for its
rewards and banned, and every reward of every accepted file, recomputed here by the run's environment opened
afresh from its spec (as any validator would), equals the reward the node claimed, rollout by rollout. The code
run uses the tiny model warm-started on the file's reference programs, so its completions hold programs that
the sandbox runs on the nodes and again on the validator. (In one process, faster: tests/test_environment_runs.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from prime_node.node.cli.devnet import succeeded
from prime_node.node.models.tiny import build_tiny_model, save_model_dir
from prime_node.node.run.settings import RunSettings, load_run_tasks
from prime_node.proofs.rollout_file import read_rollout_file
from prime_node.trainer.devnet.layout import Sizing
from prime_node.trainer.devnet.report import format_report

from support.devnet import SMALL, assert_all_gone, run_devnet, tiny_model
from support.env_runs import CODE_MAX_NEW_TOKENS, FAMILIES, code_model, write_code_tasks
from support.sandbox import sandbox_skip_reason

SKIP_CODE = sandbox_skip_reason()
RUNS = [
    *(pytest.param(name, id=name) for name in sorted(FAMILIES)),
    # A chat model: the tiny Qwen2 with a BPE tokenizer trained here and a chat template (no hub on these
    # machines); every party builds its prompts with that template.
    pytest.param("chat_model", id="chat_model"),
    pytest.param(
        "code",
        id="code",
        marks=pytest.mark.skipif(SKIP_CODE is not None, reason=SKIP_CODE or ""),
    ),
]


@pytest.mark.slow
@pytest.mark.timeout(1500)  # ~2-4 min each on 2 cores; several times that on a shared, loaded machine
@pytest.mark.parametrize("name", RUNS)
def test_devnet_on_an_environment_accepts_honest_files_bans_the_cheater_and_rewards_agree(
    tmp_path: Path, name: str
) -> None:
    if name == "code":
        env = f"code:{write_code_tasks(tmp_path / 'code.jsonl')}"
        model = code_model(tmp_path / "model", env)
        # No length targets (their instruction would change the prompts the model was trained on): rewards
        # differ within a group by which sampled programs pass. Four samples a prompt make such groups likely.
        sizing = Sizing(batch_size=16, prompts=2, samples=4, max_new_tokens=CODE_MAX_NEW_TOKENS)
    elif name == "chat_model":
        chat, tokenizer = build_tiny_model(0, chat=True)
        save_model_dir(chat, tokenizer, tmp_path / "model")
        env, model, sizing = FAMILIES["chain_sum"], tmp_path / "model", SMALL
    else:
        env, model, sizing = FAMILIES[name], tiny_model(tmp_path / "model"), SMALL
    report, devnet, _ = run_devnet(
        tmp_path,
        nodes=2,
        attacks=["inflated-rewards"],
        steps=1,
        model=model,
        task_filter=None,
        env=env,
        sizing=sizing,
    )
    text = format_report(report)
    assert report["error"] is None, text
    assert devnet.layout.env_spec == env
    assert report["steps"] >= 1, text
    assert report["honest"]["accepted_files"] >= 2 and report["honest"]["rejected_files"] == 0, text
    (adversary,) = report["adversaries"]
    assert adversary["banned"] and adversary["accepted_files"] == 0, text
    (slash, *_) = [s for s in report["slashed"] if s["name"] == adversary["name"]]
    assert slash["failed_check"] == "rewards" and slash["class"] == "fraud", text
    assert not [s for s in report["slashed"] if s["attack"] is None], "an honest node was slashed"
    assert succeeded(report) and set(report["processes"]["exit_codes"].values()) == {0}, report["processes"]
    assert_all_gone(devnet, report)

    # Every reward of every accepted file, recomputed with the run's environment opened here from its spec.
    run = RunSettings(env=env, length_targets=list(sizing.length_targets or ()))
    tasks = load_run_tasks(run, model)
    accepted = sorted((devnet.layout.trainer_dir / "accepted").glob("*.parquet"))
    assert accepted, "no accepted file in the trainer's inbox"
    task_rewards = []
    for path in accepted:
        rows = read_rollout_file(path).rows
        assert {(r.environment, r.prompt_format) for r in rows} == {
            (tasks.environment_pin, tasks.prompt_format)
        }
        for row in rows:
            task_reward, penalty, target = tasks.rewards(row)
            assert (row.task_reward, row.length_penalty, row.target_length) == (
                task_reward,
                penalty,
                target,
            ), (
                path.name,
                row.sample_index,
            )
            task_rewards.append(task_reward)
    scored = sum(r > 0 for r in task_rewards)
    print(
        f"\n{name}: {len(accepted)} accepted files, {len(task_rewards)} rollouts recomputed equal, "
        f"{scored} with a task reward above 0"
    )
    assert tasks.prompts.mode == ("chat" if name == "chat_model" else "raw"), tasks.prompts.mode
    if name == "code":  # programs passed: the sandbox ran them on the nodes and on the validator alike
        assert 1.0 in task_rewards and 0.0 in task_rewards, task_rewards
