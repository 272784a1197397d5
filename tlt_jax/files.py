"""Files a reader may open while they are being written (a resumed run, a benchmark's
partial results read after a kill)."""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Writes `text` to `path` whole or not at all: into `<name>.tmp` beside it, then renamed
    over it, so a reader (or a kill mid-write) never sees half a file. Returns the path."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path
