"""Typed dataclass configs as ml_collections ConfigDicts: what the RL run's and the drafter
warm-up's config files share."""

from __future__ import annotations

import numbers
import types
import typing

from ml_collections import config_dict


def is_int(value: typing.Any) -> bool:
    """An integer (Python's or numpy's), not a bool (True is no size)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def placeholder(cls: type, name: str) -> config_dict.FieldReference:
    """A typed placeholder for field `name` of dataclass `cls` whose default is None, so that
    `--config.<field>=...` on the command line parses to the field's type."""
    hint = typing.get_type_hints(cls)[name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(t for t in typing.get_args(hint) if t is not type(None))
    return config_dict.placeholder(hint)


def config_variant(arg: str | None, variants: tuple[str, ...]) -> str:
    """The variant a config file was asked for (`--config path.py:variant`), "" for none.

    Raises:
      ValueError: naming the variant and the file's variants, for one it does not define (a
        config without variants refuses any, instead of ignoring it and running in full).
    """
    variant = arg or ""
    if variant not in variants:
        named = [v for v in variants if v]
        if not named:
            raise ValueError(f"this config takes no variant; got {variant!r}")
        raise ValueError(f"config variant {variant!r} is not one of {named}")
    return variant
