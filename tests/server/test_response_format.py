"""The four response formats are one interface: `respond` drives each through `ResponseFormat`.

Checked on the classes (no server, no model): each has every method of the protocol with the
protocol's parameters, so `respond` and `_sse` can call any of them the same way.
"""

from __future__ import annotations

import inspect

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.server.anthropic import MessagesFormat
from mtplx.server.openai import ChatFormat, TextFormat
from mtplx.server.respond import ResponseFormat
from mtplx.server.responses import ResponsesFormat

FORMATS = (ChatFormat, TextFormat, MessagesFormat, ResponsesFormat)
METHODS = ("response", "sse_open", "sse_keepalive", "sse_chunk", "sse_error", "sse_close")


def mismatches(cls: type) -> list[str]:
    """The protocol's methods ``cls`` lacks or takes other parameters for."""
    found = []
    for name in METHODS:
        want = list(inspect.signature(getattr(ResponseFormat, name)).parameters)
        have = getattr(cls, name, None)
        if have is None or list(inspect.signature(have).parameters) != want:
            found.append(name)
    return found


def test_every_format_is_a_response_format_with_the_protocols_parameters():
    assert set(METHODS) <= set(dir(ResponseFormat))
    for cls in FORMATS:
        assert issubclass(cls, ResponseFormat), cls
        assert mismatches(cls) == [], cls


def test_a_format_missing_a_method_or_renaming_a_parameter_is_caught():
    """Negative control: a format without ``sse_keepalive``, and one whose ``sse_close`` names its
    parameters otherwise, are reported."""

    class NoKeepalive(ChatFormat):
        sse_keepalive = None

    class OtherClose(TextFormat):
        def sse_close(self, last, usage, failed):  # "usage", not "include_usage"
            return []

    assert not issubclass(type("Bare", (), {"response": lambda self, chunks: {}}), ResponseFormat)
    assert mismatches(NoKeepalive) == ["sse_keepalive"]
    assert mismatches(OtherClose) == ["sse_close"]
