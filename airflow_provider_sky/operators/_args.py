"""A mistyped keyword argument, named by the function the user called, with the nearest valid one.

Left alone, every unknown argument reached ``BaseOperator`` and came back as ``Invalid arguments were
passed to SkyClusterOperator (task_id: cluster)``: from ``sky_gang`` or ``@task.sky`` that names an
operator the user never wrote, and it never says what was meant (``hang_timout`` for ``hang_timeout``).
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

#: keyword arguments Airflow itself passes to an operator's ``__init__`` (mapped tasks, partial)
_AIRFLOW_INTERNAL = "_airflow_"


def parameters(func: Callable[..., Any]) -> tuple[str, ...]:
    """The keyword arguments ``func`` names (not ``self``, ``*args``, ``**kwargs``)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(
        name
        for name, p in inspect.signature(func).parameters.items()
        if p.kind in kinds and name not in ("self", "cls")
    )


@functools.cache
def operator_parameters(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the class's own ``__init__`` arguments, those of the classes it inherits from)."""
    own = parameters(cls.__init__)  # type: ignore[misc]
    inherited: list[str] = []
    for base in cls.__mro__[1:]:
        init = base.__dict__.get("__init__")
        if init is not None and base is not object:
            inherited += [p for p in parameters(init) if p not in own and p not in inherited]
    return own, tuple(inherited)


def check_arguments(where: str, given: Iterable[str], own: Iterable[str], more: Iterable[str] = ()) -> None:
    """A TypeError naming every argument of ``given`` that is neither in ``own`` nor ``more`` (the base
    class's), each with the nearest valid one (the caller's own arguments first)."""
    own, more = tuple(own), tuple(more)
    valid = set(own) | set(more)
    unknown = [k for k in given if k not in valid and not k.startswith(_AIRFLOW_INTERNAL)]
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, own, n=1, cutoff=0.6) or difflib.get_close_matches(
            name, more, n=1, cutoff=0.6
        )
        hints.append(f"{name!r}; did you mean {close[0]!r}?" if close else f"{name!r}")
    listed = "; ".join(hints)
    if not any(difflib.get_close_matches(n, valid, n=1, cutoff=0.6) for n in unknown):
        listed += "; its arguments are: " + ", ".join(own)
    plural = "s" if len(unknown) > 1 else ""
    raise TypeError(f"{where}: unknown argument{plural} {listed}")


def check_operator_arguments(op: Any, kwargs: Iterable[str], *also: str, task_id: str | None = None) -> None:
    """``kwargs`` (what an operator's ``__init__`` hands to ``BaseOperator``) against every argument of
    the operator and its bases; ``also``: arguments its ``__init__`` takes out of ``**kwargs`` itself."""
    cls = op if isinstance(op, type) else type(op)
    own, inherited = operator_parameters(cls)
    where = f"{cls.__name__} (task_id: {task_id})" if task_id else cls.__name__
    check_arguments(where, kwargs, own + also, inherited)
