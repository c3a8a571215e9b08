"""Pipeline-parallel inference on the wire: the stage layout a run pins, and the activation frames stages
stream to each other (docs/pipeline.md)."""
