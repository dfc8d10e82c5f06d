"""Write docs/flags.md from the `specserve` parser (specserve.cli.flags.flags_markdown).

`python scripts/gen_flags.py` rewrites the file; `--check` only reports whether it is current (exit 1
when it is not). Run it after adding or changing a flag; tests/unit/test_readme.py fails until you do.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specserve.cli.flags import flags_markdown

DOC = Path(__file__).resolve().parent.parent / "docs" / "flags.md"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if docs/flags.md is stale")
    args = parser.parse_args()
    text = flags_markdown()
    if args.check:
        current = DOC.read_text() if DOC.exists() else ""
        if current != text:
            print(f"{DOC} is stale: run python scripts/gen_flags.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
