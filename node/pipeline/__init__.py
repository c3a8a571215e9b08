"""Pipeline-parallel generation: a stage's slice of the model (stage_model.py, loaded by weights.py), the
per-stage processing of activation frames (stage.py), and drivers that run a group in one process or over
streams (driver.py, group.py). Design and trust argument: docs/pipeline.md."""
