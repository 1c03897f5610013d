"""Errors users see. Each names what was wrong (a key, a row, a file) and what to do."""


class ReinforgeError(Exception):
    """Base class: a problem in the user's input or environment, not a bug in reinforge."""


class ConfigError(ReinforgeError, ValueError):
    """A config key has a bad value, an unknown name or an impossible combination."""


class DataError(ReinforgeError):
    """A data file is missing, unreadable or has no usable rows."""


class CheckpointError(ReinforgeError):
    """A checkpoint is missing, incomplete or fails its checksum."""


class RewardError(ReinforgeError):
    """A reward function returned something that is not a reward, raised, hung, or gave too few valid rewards."""


class ServiceError(ReinforgeError):
    """Ray, MLflow or Prefect at the configured address does not answer."""


class ResourceError(ReinforgeError):
    """The Ray cluster has no room for the workers the run asks for."""


class TrainingDiverged(ReinforgeError):
    """An update made the loss, the gradient norm or the weights non-finite: the run stops at that step, before
    anything of it is checkpointed or registered."""


class OutputError(ReinforgeError):
    """An output cannot be written: a full disk, no permission, or a path that is not ours to replace."""


class StartAbandoned(ReinforgeError):
    """The workers of a run that stopped on a user's error while they were starting: killed, their start ends
    with this. Never reported (the user's error is); a ReinforgeError, so that Prefect's record of the start's
    task is dropped from the logs as that error's are."""
