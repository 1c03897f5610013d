"""Thin typed Prefect tasks over `components`. Each wraps one stage; flows put them in order."""

from components.env import apply_defaults

apply_defaults()
