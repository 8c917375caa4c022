"""A benchmark's entry under `liverl bench`: its name, one-line help, and its module docstring as the description."""

from __future__ import annotations

import argparse


def add_bench_parser(subparsers, name: str, help: str, description: str | None) -> argparse.ArgumentParser:
    """Register benchmark ``name`` under ``liverl bench``; ``description`` is shown verbatim (its table's legend)."""
    return subparsers.add_parser(
        name, help=help, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
