"""``python -m sparkdl``: the ``sparkdl`` console script without the script."""

import sys

from sparkdl._internal.cli import main

sys.exit(main())
