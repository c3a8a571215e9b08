"""Pure verification logic: TOPLOC commitments, Gumbel sampling proofs, work assignment, rollout files."""
