"""Training: SFT warm start, the policy update, and the Ray workers that run it."""
