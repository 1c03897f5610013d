"""Prefect flows: each only puts tasks in order."""

from components.env import apply_defaults

apply_defaults()
