"""Choice fields: a dataclass field annotated ``typing.Literal[...]`` (or ``Literal[...] | None``)
takes one of the literal's values. The annotation is the one place the choices are written: the
CLI's ``--help`` and ``choices`` (:mod:`dflash.commands.train`) and the validation below read it.

Light on purpose (no torch): :mod:`dflash.config` validates with it before anything heavy loads.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from functools import cache


@cache
def literal_choices(cls: type) -> dict[str, tuple]:
    """The choices of each ``Literal`` field of dataclass ``cls``, by field name (None excluded)."""
    hints = typing.get_type_hints(cls)
    choices = {}
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        literal = [a for a in args if typing.get_origin(a) is typing.Literal]
        if literal:
            choices[field.name] = typing.get_args(literal[0])
    return choices


def check_choices(instance) -> None:
    """Raise if a ``Literal`` field of dataclass ``instance`` holds a value outside its choices (None
    passes: an optional field's "use the rule").

    Raises:
        ValueError: the field's name, its value and the choices.
    """
    for field, allowed in literal_choices(type(instance)).items():
        value = getattr(instance, field)
        if value is not None:
            check_choice(field, value, allowed)


def check_choice(name: str, value, allowed) -> None:
    """Raise if ``value`` is not one of ``allowed`` (a ``Literal`` or a tuple of its values).

    Raises:
        ValueError: ``name``, ``value`` and the choices.
    """
    allowed = typing.get_args(allowed) or allowed
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}; got {value!r}")
