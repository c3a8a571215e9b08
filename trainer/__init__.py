"""The operator's roles: the trainer service, the validator and the devnet, with the GRPO recipe and the
ledger they are built on. Each role is a sub-package; trainer/errors.py holds the package's exception base."""
