"""What a remote call can end in, besides the function's own exception (which is re-raised as itself)."""

from __future__ import annotations


class RemoteError(Exception):
    """The pool could not give the call's outcome: its worker ended, it was cancelled, or what it
    returned or raised could not be read back here."""


class CallCancelled(RemoteError):
    """The call was cancelled (`Handle.cancel()`, or its function was deleted)."""


class IncompatiblePython(RemoteError):
    """No node of the pool provides the caller's Python, so the function's pickles would not load there."""


class RemoteTraceback(Exception):
    """The remote traceback, as the `__cause__` of a re-raised exception: printed under it."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n\nOn the pool:\n" + self.text.rstrip()
