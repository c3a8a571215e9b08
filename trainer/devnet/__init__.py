"""`prime-node devnet`: a whole swarm on one machine, as the demo and the end-to-end test."""
