"""Per-stage records of a pipelined group and their verification with blame (docs/pipeline.md)."""
