"""Progress of long work (warming a corpus, a calibration): a tqdm bar when tqdm is installed, else log lines."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

log = logging.getLogger("kvrag")

__all__ = ["progress_reporter"]


@contextlib.contextmanager
def progress_reporter(
    progress: bool | Callable[[int, int], None], label: str, unit: str = "window"
) -> Iterator[Callable[[int, int], None] | None]:
    """A ``report(done, total)`` callback for ``progress``: ``False`` none, a callable itself, ``True`` a
    bar counting ``unit`` (``window``, ``question``)."""
    if not progress:
        yield None
        return
    if callable(progress):
        yield progress
        return
    try:
        from tqdm.auto import tqdm
    except ImportError:  # no tqdm: a line every ~10 s
        last = [0.0]

        def line(done: int, total: int) -> None:
            now = time.monotonic()
            if done == total or now - last[0] >= 10:
                last[0] = now
                log.warning("%s: %d/%d", label, done, total)

        yield line
        return
    bar = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=label, unit=unit)
        bar.update(done - bar.n)

    try:
        yield update
    finally:
        if bar is not None:
            bar.close()
