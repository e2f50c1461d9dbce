"""Argument checks shared by ``OptimizeConfig`` and the entry points.

A check is ``check(name, value) -> value``: it returns the value normalised (a string of names becomes a
one-element tuple, never its characters) or raises ``TypeError`` for a wrong type and ``ValueError`` for a wrong
value, with a message that names the argument and its valid choices. The catalogues of valid names (plan kinds,
hardware profiles, topologies) are read when a check runs, so that kinds registered later count, and this
module imports nothing heavy.
"""
from __future__ import annotations

import math
import numbers
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

Check = Callable[[str, Any], Any]


def _got(value: Any) -> str:
    return f"got {type(value).__name__} {value!r}"


def _choices(items: Iterable[Any]) -> str:
    return ", ".join(str(c) for c in items)


def one_of(choices: tuple[Any, ...], what: str = "valid choices") -> Check:
    """The value must be one of ``choices`` (a string choice never matches a non-string)."""
    kinds = {type(c) for c in choices if c is not None}

    def check(name: str, value: Any) -> Any:
        if kinds == {str} and value is not None and not isinstance(value, str):
            raise TypeError(f"{name} must be a str, {_got(value)}; {what}: {_choices(choices)}")
        if any(value is c or (type(value) is type(c) and value == c) for c in choices):
            return value
        raise ValueError(f"{name}={value!r} is not valid; {what}: {_choices(choices)}")

    return check


def optional(inner: Check) -> Check:
    """``None`` passes unchanged; anything else goes through ``inner``."""

    def check(name: str, value: Any) -> Any:
        return None if value is None else inner(name, value)

    return check


def boolean(name: str, value: Any) -> bool:
    """Exactly ``True`` or ``False``: a string such as ``"no"`` is an error, not a truthy value."""
    if isinstance(value, bool):
        return value
    raise TypeError(f"{name} must be True or False, {_got(value)}")


def integer(lo: int, hi: int | None = None) -> Check:
    """An int (not a bool, not a numeric string) in ``lo..hi``."""
    span = f"in {lo}..{hi}" if hi is not None else f">= {lo}"

    def check(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int {span}, {_got(value)}")
        if value < lo or (hi is not None and value > hi):
            raise ValueError(f"{name} must be {span}, got {value}")
        return int(value)

    return check


def int_at_least(lo: int) -> Callable[[str], int]:
    """An argparse ``type`` for an integer option ``>= lo``: argparse then names the option and the bad text
    (``argument --calls: must be an integer >= 1, got '0'``) before the command starts any work."""
    import argparse

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {text!r}")
        return value

    return parse


def float_at_least(lo: float, strict: bool = False) -> Callable[[str], float]:
    """An argparse ``type`` for a finite number option ``>= lo`` (``> lo`` when ``strict``): a negative time budget
    or timeout, NaN or inf is refused with the option's name before the command starts any work."""
    import argparse

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < lo or (strict and value == lo):
            raise argparse.ArgumentTypeError(f"must be a number {'>' if strict else '>='} {lo:g}, got {text!r}")
        return value

    return parse


def device_kind(text: str) -> str:
    """An argparse ``type`` for a ``--device`` option: ``cuda``, ``cuda:N`` or ``cpu``."""
    import argparse

    import torch

    try:
        kind = torch.device(text).type
    except (RuntimeError, ValueError):
        kind = None
    if kind not in ("cuda", "cpu"):
        raise argparse.ArgumentTypeError(f"expected cuda, cuda:N or cpu, got {text!r}")
    return text


def real(lo: float) -> Check:
    """A finite number ``>= lo``, returned as a float."""

    def check(name: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a number >= {lo:g}, {_got(value)}")
        if not math.isfinite(value) or value < lo:
            raise ValueError(f"{name} must be a finite number >= {lo:g}, got {value!r}")
        return float(value)

    return check


def names(valid: Callable[[], Iterable[str]] | None = None) -> Check:
    """A tuple of strings from one string or any iterable of strings (each in ``valid()`` when given)."""

    def check(name: str, value: Any) -> tuple[str, ...]:
        if isinstance(value, str):
            items: tuple[Any, ...] = (value,)
        elif isinstance(value, (bytes, Mapping)) or not isinstance(value, Iterable):
            raise TypeError(f"{name} must be a string or a list of strings, {_got(value)}")
        else:
            items = tuple(value)
        for item in items:
            if not isinstance(item, str):
                raise TypeError(f"{name} must hold strings, {_got(item)} in {value!r}")
        if valid is not None:
            known = list(valid())
            unknown = [item for item in items if item not in known]
            if unknown:
                raise ValueError(f"{name}: unknown {', '.join(map(repr, unknown))}; valid: {_choices(known)}")
        return items

    return check


def name_in(valid: Callable[[], Iterable[str]], paths: str | None = None) -> Check:
    """One string in ``valid()``, or, when ``paths`` is a suffix such as ``".json"``, an existing file ending so."""

    def check(name: str, value: Any) -> str:
        if isinstance(value, os.PathLike) and paths:
            value = os.fspath(value)
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str, {_got(value)}; valid: {_choices(valid())}"
                            + (f", or a path to a {paths} file" if paths else ""))
        if paths and value.endswith(paths):
            if not Path(value).is_file():
                raise ValueError(f"{name}={value!r}: no such file")
            return value
        known = list(valid())
        if value not in known:
            raise ValueError(f"unknown {name} {value!r}; valid: {_choices(known)}"
                             + (f", or a path to a {paths} file" if paths else ""))
        return value

    return check


def writable_file(name: str, value: Any) -> str:
    """A path to a file that can be appended to: not a directory, and under a directory that exists and is
    writable or can be created there. Nothing is created here."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a file path (str), {_got(value)}")
    if not value:
        raise ValueError(f"{name} must be a file path, got an empty string")
    path = Path(value)
    if path.is_dir():
        raise ValueError(f"{name}={value!r} is a directory; give the path of a file")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{name}={value!r} is not writable")
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{name}={value!r} cannot be created: {parent} is a file, not a directory")
    if not path.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{name}={value!r} cannot be created: {parent} is not writable")
    return value


def sliding_windows(name: str, value: Any) -> tuple[tuple[str, int], ...]:
    """``(module path, window)`` pairs (or a ``{path: window}`` dict) with a window > 0."""
    pairs = value.items() if isinstance(value, Mapping) else value
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Iterable):
        raise TypeError(f"{name} must be (module path, window) pairs or a {{path: window}} dict, {_got(value)}")
    out = []
    for pair in pairs:
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Iterable) or len(tuple(pair)) != 2:
            raise ValueError(f"{name} must be (module path, window) pairs, got {pair!r} in {value!r}")
        path, window = tuple(pair)
        if not isinstance(path, str):
            raise TypeError(f"{name}: a module path must be a str, {_got(path)}")
        if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window <= 0:
            raise ValueError(f"{name}: the window of {path!r} must be an int > 0, got {window!r}")
        out.append((path, int(window)))
    return tuple(out)


# --------------------------------------------------------------------------------------------- catalogues
def plan_kinds() -> list[str]:
    """Every plan kind whose plan type is registered (``attnopt.plan.PLAN_KINDS``)."""
    from .plan import PLAN_KINDS

    return sorted(PLAN_KINDS)


def hardware_names() -> list[str]:
    """Built-in profiles, ``local``, and the calibrated profiles in the cache."""
    from .hardware import builtin_names, cached_profile_names

    return builtin_names() + ["local"] + cached_profile_names()


def topology_names() -> list[str]:
    from .topology import topology_names as names_

    return names_()
