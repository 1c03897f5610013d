"""Tracking (MLflow) and checkpoints."""
