"""`python -m specserve.cli ARGS`: the same as the `specserve` command."""

import sys

from specserve.cli.main import main

sys.exit(main())
