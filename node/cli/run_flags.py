"""The run's parameters as flags: the same set on every command that takes part in a run.

`start`, `rollout`, `verify`, `validator` and `trainer` all load the `run` section (node/run/settings.py
RunSettings), and the trainer announces it with every policy (node/run/announcement.py), so each of them
accepts the same flags for it, with the same names and defaults (those of RunSettings' fields).
"""

from __future__ import annotations

from .flags import Flag, SettingsFlags

RUN_FLAGS = (
    Flag("run.run_id"),
    Flag("run.run_seed"),
    Flag("run.env", metavar="NAME[:ARGS]"),
    Flag("run.tasks"),
    Flag("run.task_seed"),
    Flag("run.samples"),
    Flag("run.length_targets"),
    Flag("run.length_alpha"),
    Flag("run.compute_dtype"),
    Flag("run.temperature"),
    Flag("run.max_new_tokens"),
    Flag("run.system_prompt"),
    Flag("run.run_kind"),
    Flag("run.annotators", metavar="MODEL"),
)


def add_run_flags(flags: SettingsFlags, *, run_id: Flag = RUN_FLAGS[0]) -> None:
    """Add a flag for every field of RunSettings, in a group of their own; `run_id` replaces the run id's
    flag where it sets more (the validator's names the DHT's run too)."""
    group = flags.parser.add_argument_group(
        "run parameters (every party of a run must agree on them; the trainer announces its own)"
    )
    flags.add(run_id, *RUN_FLAGS[1:], group=group)
