"""`prime-node validator`: receives rollout files, admits them fairly, verifies them against the announced
checkpoint, records signed verdicts in the ledger, publishes bans, serves the HTTP API and dashboard."""
