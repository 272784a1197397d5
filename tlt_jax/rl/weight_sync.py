"""The one checked entry point through which new weights reach a rollout engine."""

from __future__ import annotations

import jax


def check_compatible(current, new) -> None:
    """Raises if `new` cannot replace `current` in compiled programs without recompiling.

    Checks, in order: tree structure, then per leaf shape, dtype and sharding.

    Raises:
      ValueError: naming the first mismatching leaf and both values.
    """
    current_paths, current_tree = jax.tree_util.tree_flatten_with_path(current)
    new_paths, new_tree = jax.tree_util.tree_flatten_with_path(new)
    if current_tree != new_tree:
        current_keys = {jax.tree_util.keystr(p) for p, _ in current_paths}
        new_keys = {jax.tree_util.keystr(p) for p, _ in new_paths}
        raise ValueError(
            "weight sync: tree structure differs; missing "
            f"{sorted(current_keys - new_keys)[:5]}, "
            f"unexpected {sorted(new_keys - current_keys)[:5]}"
        )
    for (path, old), (_, value) in zip(current_paths, new_paths, strict=True):
        name = jax.tree_util.keystr(path)
        if getattr(old, "shape", None) != getattr(value, "shape", None):
            raise ValueError(f"weight sync: {name} has shape {value.shape}; expected {old.shape}")
        if getattr(old, "dtype", None) != getattr(value, "dtype", None):
            raise ValueError(f"weight sync: {name} has dtype {value.dtype}; expected {old.dtype}")
        old_sharding = getattr(old, "sharding", None)
        new_sharding = getattr(value, "sharding", None)
        if (
            old_sharding is not None
            and new_sharding is not None
            and not (old_sharding.is_equivalent_to(new_sharding, len(old.shape)))
        ):
            raise ValueError(
                f"weight sync: {name} has sharding {new_sharding}; expected {old_sharding}"
            )
