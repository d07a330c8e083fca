"""The RLHF loop: rollout -> experience -> advantages -> losses -> trainer."""
