"""The GRPO recipe (INTELLECT-2): hyper-parameters, advantages, the clipped token-level loss, packing, the
learning-rate schedule, one optimizer step, and the same step sharded with FSDP. torch only: no swarm, no
disk layout; the trainer service drives it."""
