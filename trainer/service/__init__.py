"""`prime-node trainer`: the process that reads accepted rollouts, batches them, runs the GRPO recipe,
saves its own state and publishes each step's checkpoint to the swarm."""
