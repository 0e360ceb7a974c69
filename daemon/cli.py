"""The ``hicache`` command line."""

from __future__ import annotations

import argparse
import sys

from hicache import __version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hicache", description=__doc__)
    parser.add_argument("--version", action="version", version=f"hicache {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the daemon in the foreground")
    serve.add_argument("--config", help="TOML configuration file")
    args = parser.parse_args(argv)
    if args.command == "serve":
        print(
            "hicache: daemon not built yet — the tree, keys, spec and page allocators are "
            "installed; the ZeroMQ daemon arrives with its own issue.",
            file=sys.stderr,
        )
        return 0
    return 2
