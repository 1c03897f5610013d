"""The RL core: advantage estimators, policy losses, KL estimators and loss aggregation."""
