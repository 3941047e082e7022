"""`python -m benchmarks NAME [args]`: runs one kept benchmark (benchmarks/registry.py).

`python -m benchmarks` lists them with one line each; an unknown NAME is a one-line
error naming the closest one (exit status 2).
"""

from __future__ import annotations

import sys

from benchmarks.registry import describe, run


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(describe())
        return 0
    try:
        run(argv[0], argv[1:])
    except ValueError as e:
        if not str(e).startswith("unknown benchmark"):
            raise
        print(f"python -m benchmarks: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
