"""Thin typed Prefect tasks over `components`. Each wraps one stage; flows put them in order."""
