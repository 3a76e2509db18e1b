"""Run ``benchmarks`` with research-only selections registered (shared by the research harnesses).

kvrag validates ``selection=`` against the fixed tuple :data:`kvrag.config.SELECTIONS` (also the
integrations' types); a harness adds its names to it for this process only, here in one place.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import kvrag.config
import kvrag.engine.serving.requests
from kvrag.engine.reuse.selection.base import register_selection


def install(strategies: dict[str, Callable]) -> None:
    """Make each ``name`` selectable (``blend@r+selection=name``) in this process."""
    kvrag.config.SELECTIONS = kvrag.config.SELECTIONS + tuple(n for n in strategies if n not in kvrag.config.SELECTIONS)
    kvrag.engine.serving.requests.SELECTIONS = kvrag.config.SELECTIONS  # imported there by value
    for name, strategy in strategies.items():
        register_selection(name, strategy)


def run_bench(strategies: dict[str, Callable]) -> None:
    """``python -m benchmarks`` with the command line's arguments and ``strategies`` installed."""
    install(strategies)
    from benchmarks.__main__ import main

    sys.exit(main(sys.argv[1:]))
