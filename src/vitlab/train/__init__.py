"""Training: engine (one epoch), optimisers and schedules, checkpoints, distributed set-up, runs."""
