"""Errors users see. Each names what was wrong (a key, a row, a file) and what to do."""

import errno

# a full disk or quota as the OS words it, inside errors of libraries that wrap it in their own type
# (safetensors' writer: "I/O error: No space left on device (os error 28)")
_NO_SPACE_WORDS = ("No space left on device", "Disk quota exceeded", "(os error 28)", "(os error 122)")


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


def _chain(exc: BaseException, depth: int = 8):
    """The exception, what Ray's error carries (`cause`), and what it was raised from or during."""
    seen: list[BaseException] = []
    todo = [exc]
    while todo and len(seen) < depth:
        e = todo.pop(0)
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [getattr(e, "cause", None), e.__cause__, e.__context__]
    return seen


def no_space(exc: BaseException) -> BaseException | None:
    """The error in `exc`'s chain that says a disk or quota is full (an OSError's ENOSPC or EDQUOT, or the OS's
    words inside another library's error), or None."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e
        if any(words in str(e) for words in _NO_SPACE_WORDS):
            return e
    return None
