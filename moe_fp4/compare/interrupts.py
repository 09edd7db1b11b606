"""Ctrl-C before training: SIGINTs that arrive while the CLI still imports and checks.

The CLI's handler (:func:`install`) records each SIGINT and raises KeyboardInterrupt, as Python's own handler
does. A library that swallows that KeyboardInterrupt during its import (a broad ``except`` around an optional
import) would otherwise let the run go on as if Ctrl-C had never been pressed; the record stays, and training
checks it before its first step (:func:`raise_if_pending`); an error raised in its place (an import that fails
because it was interrupted: torch's, transformers') is taken for the interrupt it is. Nothing here imports
anything heavy: it runs first.
"""

from __future__ import annotations

import signal
import threading

_PENDING: list[int] = []


def _handler(signum, _frame):
    _PENDING.append(signum)
    raise KeyboardInterrupt


def install():
    """Record SIGINTs from now on, none recorded before (main thread only; elsewhere nothing changes) -> the
    handler it replaced, for :func:`restore`."""
    _PENDING.clear()
    if threading.current_thread() is threading.main_thread():
        return signal.signal(signal.SIGINT, _handler)
    return None


def restore(old) -> None:
    """Put back the handler :func:`install` replaced (None: it replaced nothing)."""
    if old is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, old)


def pending() -> bool:
    """Whether a SIGINT was recorded."""
    return bool(_PENDING)


def raise_if_pending() -> None:
    """KeyboardInterrupt if a SIGINT was recorded (and its KeyboardInterrupt lost on the way)."""
    if _PENDING:
        raise KeyboardInterrupt


__all__ = ["install", "pending", "raise_if_pending", "restore"]
