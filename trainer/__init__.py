"""The operator side: GRPO trainer, checkpoint publishing, the validator, the ledger and the devnet."""
