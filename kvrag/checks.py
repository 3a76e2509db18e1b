"""Checks of setting values, shared by the config and the engine's parts: one error naming the setting.

A check is a function ``check(name, value)`` that returns the value (a number as a float) or raises
:class:`~kvrag.errors.InvalidRequestError` ``"{name} must be ..., got {value!r}"``. Build one with
:func:`integer`, :func:`number`, :func:`share`, :func:`flag`, :func:`one_of` or :func:`text`
(``also=``: literal values accepted besides, ``None`` or ``"auto"``)::

    stride = integer(1)("probe_stride", stride)

A dataclass of settings names each field's check once (:func:`setting`) and inherits
:class:`Checked`, whose ``__post_init__`` runs them. Imports nothing but :mod:`kvrag.errors`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

from kvrag.errors import InvalidRequestError

__all__ = [
    "Check",
    "Checked",
    "setting",
    "is_int",
    "is_number",
    "integer",
    "number",
    "share",
    "flag",
    "one_of",
    "text",
]

Check = Callable[[str, Any], Any]


def is_int(value: object) -> bool:
    """An int that is not a bool (``True`` is an int to Python, never a count to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An int or a float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _accepts(value: object, also: tuple) -> bool:
    return any(value is a or (value == a and not isinstance(value, bool)) for a in also)


def _describe(what: str, also: tuple) -> str:
    """``"'auto' or an integer >= 0"``, ``"an integer >= 1 or None"``: literals first, ``None`` last."""
    before = [repr(a) for a in also if a is not None]
    return " or ".join([*before, what] + (["None"] if None in also else []))


def _fail(name: str, what: str, value: object, note: str = "") -> InvalidRequestError:
    note = f" ({note})" if note else ""
    return InvalidRequestError(f"{name} must be {what}{note}, got {value!r}")


def integer(least: int, *, also: tuple = (), note: str = "") -> Check:
    """An integer (not a bool) ``>= least``, or one of ``also``; ``note`` says why in the error."""
    what = _describe(f"an integer >= {least}", also)

    def check(name: str, value: Any) -> Any:
        if _accepts(value, also):
            return value
        if not is_int(value) or value < least:
            raise _fail(name, what, value, note)
        return value

    return check


def number(
    low: float, high: float | None = None, *, open_low: bool = False, finite: bool = False, also: tuple = ()
) -> Check:
    """A number ``>= low`` (``> low`` with ``open_low``), at most ``high`` if given, finite if asked;
    returned as a float. Or one of ``also``, as it is."""
    if high is not None:
        what = f"a number in {'(' if open_low else '['}{low:g}, {high:g}]"
    else:
        what = f"{'a finite' if finite else 'a'} number {'>' if open_low else '>='} {low:g}"
    what = _describe(what, also)

    def check(name: str, value: Any) -> Any:
        if _accepts(value, also):
            return value
        ok = (
            is_number(value)
            and (value > low if open_low else value >= low)
            and (high is None or value <= high)
            and (not finite or math.isfinite(value))
        )
        if not ok:
            raise _fail(name, what, value)
        return float(value)

    return check


def share(*, also: tuple = ()) -> Check:
    """A share: a number in [0, 1], as a float."""
    return number(0.0, 1.0, also=also)


def flag(*, also: tuple = ()) -> Check:
    """``True`` or ``False`` (not 0 or 1: a setting that is a switch says so)."""

    def check(name: str, value: Any) -> Any:
        if not isinstance(value, bool) and not _accepts(value, also):
            raise _fail(name, _describe("True or False", also), value)
        return value

    return check


def one_of(choices: Iterable, *, also: tuple = ()) -> Check:
    """One of ``choices`` (a bool matches only a bool), or one of ``also``."""
    choices = tuple(choices)
    what = _describe(f"one of {choices}", also)

    def check(name: str, value: Any) -> Any:
        if _accepts(value, choices + also):
            return value
        raise _fail(name, what, value)

    return check


def text(*, what: str = "a non-empty string", also: tuple = ()) -> Check:
    """A non-empty string (``what`` names what it is in the error: ``"the name of a policy"``)."""
    what = _describe(what, also)

    def check(name: str, value: Any) -> Any:
        if _accepts(value, also):
            return value
        if not isinstance(value, str) or not value:
            raise _fail(name, what, value)
        return value

    return check


def setting(default: Any, check: Check | None = None) -> Any:
    """A dataclass field with its default and its check (``None``: checked where it is used)."""
    return dataclasses.field(default=default, metadata={"check": check})


class Checked:
    """Base of a frozen dataclass whose fields name their checks (:func:`setting`): building one runs
    each check in field order and keeps the value it returns, then :meth:`_check_together`."""

    __slots__ = ()

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            check = field.metadata.get("check")
            if check is not None:
                object.__setattr__(self, field.name, check(field.name, getattr(self, field.name)))
        self._check_together()

    def _check_together(self) -> None:
        """Rules over several fields (one small explicit check each); none by default."""
