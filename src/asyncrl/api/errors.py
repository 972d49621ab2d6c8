"""Errors that cross package boundaries."""


class InferenceError(RuntimeError):
    """The inference engine failed (server unreachable, timed out, or answered an error).

    The rollout side treats it as fatal: an episode cannot be retried into a working state
    while its engine is broken, and counting it as a bad sample would hide the cause.
    """
