"""Names (and a bound) every layer must spell the same way.

A run id prefixes the run's DHT keys, names its checkpoint manifests and is carried by every rollout row and
policy record; the contributor, validator and trainer configs and those wire formats all check it with this
one rule (a leading letter or digit: it also appears on command lines and in paths).
"""

RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
RUN_ID_RULE = "1-64 of A-Z a-z 0-9 . _ -, starting with a letter or digit"

# Thinking-length targets, in tokens: the run setting and the policy record that announces it share the bound.
MAX_LENGTH_TARGET = 1_000_000

# A model's label in a synthetic run's annotator list and in a dataset's `model` column (docs/synthetic.md):
# the same rule as a run id, since each annotating model's rollouts come from a synthetic run of its own.
MODEL_LABEL_PATTERN = RUN_ID_PATTERN
MAX_ANNOTATORS = 8
