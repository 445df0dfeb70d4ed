"""The one error type for user mistakes: its message is one line naming the thing and the problem."""


class MtplxError(ValueError):
    """A user-facing error (bad model path, bad sampler value, mismatched head, ...).

    The CLI prints ``str(err)`` on one line and exits non-zero, without a traceback.
    """
