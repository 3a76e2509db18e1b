"""The ``kvrag`` command line: ``kvrag serve ...``.

The benchmarks (and the research experiments, e.g. the calibration of ``recompute_ratio="auto"``)
live beside the package, not in it: ``python -m benchmarks`` from a clone.
"""

from __future__ import annotations

import sys

USAGE = """usage: kvrag serve [--host H] [--port P] [--model M] [--config FIELD=VALUE ...]

  serve      an OpenAI-compatible server over kvrag's engine

`kvrag serve --help`: all options."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] == "serve":
        from kvrag.server.cli import main as serve_main

        return serve_main(argv[1:])
    print(f"kvrag: unknown command {argv[0]!r}; try `kvrag --help`", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
