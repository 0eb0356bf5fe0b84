"""The one error capture raises: what went wrong, and where in the user's code."""

from __future__ import annotations


class CaptureError(ValueError):
    """A step that cannot be captured faithfully; the CLI exits 2 with its message."""

    def __init__(self, message: str, source: str | None = None) -> None:
        super().__init__(f"{message} (at {source})" if source else message)
        self.message, self.source = message, source
