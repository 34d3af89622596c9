"""``python -m sparkdl.cli``: the ``sparkdl`` console script without the script."""

import sys

from sparkdl.cli import main

sys.exit(main())
