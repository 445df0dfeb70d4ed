"""The one error type for user mistakes: its message is one line naming the thing and the problem."""


class MtplxError(ValueError):
    """A user-facing error (bad model path, bad sampler value, mismatched head, ...).

    The CLI prints ``str(err)`` on one line and exits non-zero, without a traceback.
    """


def first_line(err: BaseException) -> str:
    """The first line of a library's error message (its type name when it has none), for a one-line error."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def shown(text: object) -> str:
    """``text`` as typed when it prints as it is, else quoted (its repr): a name holding a newline or
    another control character stays visible, and the message naming it stays one line."""
    text = str(text)
    return text if text.isprintable() else repr(text)
