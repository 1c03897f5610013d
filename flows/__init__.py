"""Prefect flows: each only puts tasks in order."""
