"""reinforge's library: everything but orchestration. Nothing here imports Prefect."""
