"""Acceptance harnesses of earlier issues: whole flows on the dev set, judged over many requests."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def parse_checked(
    ap: argparse.ArgumentParser, dataset_path: Callable[[str | None], Path | None]
) -> tuple[argparse.Namespace, Path]:
    """A harness's arguments and its dev set's path, checked before anything runs: an ``--out`` that
    names a directory and a missing dev set each end the run with one message."""
    args = ap.parse_args()
    out = getattr(args, "out", None)
    if out and Path(out).is_dir():  # found before the run, not when writing after it
        ap.error(f"--out names a file (JSON); {out} is a directory")
    path = dataset_path(args.data)
    if path is None:
        raise SystemExit("the dev set is not there: pass --data path/to/musique_dev.json")
    return args, path
