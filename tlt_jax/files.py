"""Files a reader may open while they are being written (a resumed run, a benchmark's
partial results read after a kill)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def check_local_dir(path: str | os.PathLike, flag: str) -> Path:
    """`path` as a local directory to write into (it need not exist yet), or a ValueError that
    names `flag`: a URL (`gs://...`; Python's file calls would make a local folder named
    `gs:`) or a path that exists and is no directory."""
    text = os.fspath(path)
    if "://" in text:
        raise ValueError(f"{flag}={text!r} is a URL; this writes through the local file "
                         "system: give a local path, or mount the bucket (e.g. gcsfuse) and "
                         "give the mount's path")  # fmt: skip
    local = Path(text).expanduser()
    if local.exists() and not local.is_dir():
        raise ValueError(f"{flag}={text!r} exists and is not a directory")
    return local


def check_output_file(path: str | os.PathLike, flag: str) -> Path:
    """`path` as a file this process can write its results to at the end, or a ValueError
    naming `flag`, now rather than after the run: a directory, or a folder that cannot be
    made or written into. Makes the missing folders; writes no file."""
    out = Path(path).expanduser()
    if out.is_dir():
        raise ValueError(f"{flag}={os.fspath(path)!r} is a directory; expected a file's path")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag}={os.fspath(path)!r} cannot be written: its folder cannot "
                         f"be made: {e}") from e  # fmt: skip
    writable = os.access(out.parent, os.W_OK | os.X_OK)
    if not writable or (out.exists() and not os.access(out, os.W_OK)):
        raise ValueError(f"{flag}={os.fspath(path)!r} cannot be written (permissions)")
    return out


def register_output_checks(*names: str) -> None:
    """Checks these absl flags' paths (`check_output_file`) when the flags are parsed, before
    the script does anything: a benchmark whose results could not be written fails in a
    second, not after its run."""
    from absl import flags

    def check(name: str):
        def validator(value) -> bool:
            if value:
                try:
                    check_output_file(value, f"--{name}")
                except ValueError as e:
                    raise flags.ValidationError(str(e)) from e
            return True

        return validator

    for name in names:
        flags.register_validator(name, check(name))


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Writes `text` to `path` whole or not at all: into `<name>.tmp` beside it, then renamed
    over it, so a reader (or a kill mid-write) never sees half a file; a missing parent
    folder is made (a benchmark's results are not lost to a typo in its folder). Returns the
    path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def jsonable(value: Any, non_finite: Callable[[float], Any] = str) -> Any:
    """`value` as JSON can hold it: numpy scalars and arrays become Python numbers and lists,
    dict keys strings, and a float that is not finite `non_finite(value)` (by default the
    strings "nan" / "inf" / "-inf"; JSON has no such numbers)."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return non_finite(value)
    if isinstance(value, list | tuple):
        return [jsonable(v, non_finite) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v, non_finite) for k, v in value.items()}
    return value


def to_json(result: Any, indent: int | None = 2) -> str:
    """A benchmark's results as strict JSON text: a figure that is not a finite number (a ratio
    with nothing measured) is null, never the NaN that `json.dumps` writes and JSON readers
    refuse."""
    return json.dumps(jsonable(result, lambda _: None), indent=indent, allow_nan=False)


def write_json(path: str | os.PathLike, result: Any, indent: int | None = 2) -> Path:
    """`to_json(result)` into `path`, whole or not at all (`write_text_atomic`)."""
    return write_text_atomic(path, to_json(result, indent) + "\n")
