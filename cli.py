"""The `mleagle` command: generate, bench and serve subcommands (filled in by their modules)."""

import sys


def main(argv: list[str] | None = None) -> int:
    print("mleagle: not yet", file=sys.stderr)
    return 2
