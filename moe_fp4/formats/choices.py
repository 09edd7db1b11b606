"""Arguments that take one of a few named values: a wrong value is refused with the parameter and every
choice, ``precision='fp16' is not one of 'bf16', 'fp8', 'fp4'``, instead of Python's ``'fp16' is not a valid
Precision``. The enums of the layers above (precision, recompute, storage, wire format, role) derive from
:class:`Choice`; it sits in formats, the lowest layer they all may import.
"""

from __future__ import annotations

import enum


def not_one_of(name: str, value, choices) -> str:
    """-> ``"precision='fp16' is not one of 'bf16', 'fp8', 'fp4'"`` (``name value`` where the name is not an
    identifier: ``"wire format 'x' is not one of ..."``); choices: the accepted values, in order."""
    given = f"{name}={value!r}" if name.replace(".", "").isidentifier() else f"{name} {value!r}"
    return f"{given} is not one of {', '.join(repr(c) for c in choices)}"


class Choice(str, enum.Enum):
    """A str enum whose members are the choices of one parameter, named by the class's ``__parameter__``:
    ``Precision("fp16")`` raises ValueError("precision='fp16' is not one of 'bf16', 'fp8', 'fp4'"), and
    :meth:`of` names another (``WireFormat.of(v, "EPConfig.combine")``). Members compare, hash and print
    as those of ``(str, enum.Enum)``."""

    __parameter__ = "value"

    @classmethod
    def _missing_(cls, value):
        raise ValueError(not_one_of(cls.__parameter__, value, [m.value for m in cls]))

    @classmethod
    def of(cls, value, name: str | None = None):
        """``value`` (a member, or its value) -> the member; ValueError naming ``name`` (default: the
        class's parameter) and every choice otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(not_one_of(name or cls.__parameter__, value, [m.value for m in cls])) from None


__all__ = ["Choice", "not_one_of"]
