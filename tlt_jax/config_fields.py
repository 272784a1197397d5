"""Typed dataclass configs as ml_collections ConfigDicts: what the RL run's and the drafter
warm-up's config files share."""

from __future__ import annotations

import types
import typing

from ml_collections import config_dict


def placeholder(cls: type, name: str) -> config_dict.FieldReference:
    """A typed placeholder for field `name` of dataclass `cls` whose default is None, so that
    `--config.<field>=...` on the command line parses to the field's type."""
    hint = typing.get_type_hints(cls)[name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(t for t in typing.get_args(hint) if t is not type(None))
    return config_dict.placeholder(hint)
