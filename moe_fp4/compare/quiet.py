"""Known-harmless noise that ``moe-fp4 compare`` triggers in other libraries, silenced narrowly and only
while compare runs (its package check's imports included, and the examples that import those libraries):
:func:`quiet_kineto` (the profiler's C++ log lines) and :func:`quiet_third_party` (named log lines and
warnings, each matched by its logger or category and its message).

Nothing is silenced globally: every filter is matched on the exact message it was written for, and
removed when the context exits, so a program that imports moe_fp4 keeps every other warning.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import warnings

# logger name -> the messages of that logger dropped while compare runs
KNOWN_LOG_LINES = {
    # torchao (imported by transformers under --hook) tries every prebuilt extension of its wheel; those
    # built for other Python versions or GPUs fail to load, harmlessly (compare uses none of them).
    "torchao": re.compile(r"^Failed to load \S*torchao[/\\]_C\w*\.\S*\.so\b"),
    # torchao registers its enums with torch's pytree; torch >= 2.12 supports them natively and says so.
    "torch.utils._pytree": re.compile(r"is an Enum subclass and is now natively supported by torch\.compile"),
}
# (category, message regex) of warnings.filterwarnings, dropped while compare runs
KNOWN_WARNINGS = (
    # the deprecated torch.cuda.amp / torch.cpu.amp spellings, inside third-party code compare calls
    (FutureWarning, r"`torch\.(cuda|cpu)\.amp\.\w+\(.*\)` is deprecated"),
    # torchtitan's MoE router enters autocast(float32), which CPU autocast declines (moe_fp4 enters no autocast)
    (UserWarning, r"In CPU autocast, but the target dtype is not supported"),
)


class _DropKnown(logging.Filter):
    def __init__(self, pattern: re.Pattern):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return self.pattern.search(record.getMessage()) is None
        except Exception:  # noqa: BLE001 - a record that cannot be formatted is not ours to drop
            return True


@contextlib.contextmanager
def quiet_third_party():
    """While the context is open, drop the log lines in ``KNOWN_LOG_LINES`` (a filter on each named
    logger) and the warnings in ``KNOWN_WARNINGS``; everything else passes as before."""
    added = []
    for name, pattern in KNOWN_LOG_LINES.items():
        logger, f = logging.getLogger(name), _DropKnown(pattern)
        logger.addFilter(f)
        added.append((logger, f))
    try:
        with warnings.catch_warnings():
            for category, message in KNOWN_WARNINGS:
                warnings.filterwarnings("ignore", message=message, category=category)
            yield
    finally:
        for logger, f in added:
            logger.removeFilter(f)


@contextlib.contextmanager
def quiet_kineto():
    """Keep the profiler's C++ side (kineto) from writing its own log lines ("USDT: ... profiler_start" /
    "profiler_stop", once per profiled run on every rank) to stderr. Kineto reads KINETO_LOG_LEVEL once,
    when the first profile starts; 6 is above its highest severity. A level the user set is kept, and the
    variable is restored so that no child process inherits the change."""
    if "KINETO_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["KINETO_LOG_LEVEL"] = "6"
    try:
        yield
    finally:
        os.environ.pop("KINETO_LOG_LEVEL", None)


__all__ = ["KNOWN_LOG_LINES", "KNOWN_WARNINGS", "quiet_kineto", "quiet_third_party"]
