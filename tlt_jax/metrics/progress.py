"""Progress bars of the RL phases (tqdm), off unless asked for or stderr is a terminal."""

from __future__ import annotations

import contextlib
import sys


class NoBar:
    def update(self, n: int = 1) -> None:
        del n


@contextlib.contextmanager
def progress_bar(enabled: bool | None, desc: str, total: int):
    """A tqdm bar over micro-batches when progress is on (default: stderr is a terminal)."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        yield NoBar()
        return
    from tqdm.auto import tqdm

    with tqdm(total=total, desc=desc, unit="micro-batch", dynamic_ncols=True, leave=False) as bar:
        yield bar
