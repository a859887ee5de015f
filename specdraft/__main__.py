"""``python -m specdraft``: the same CLI as the ``specdraft`` console script."""

import sys

from .cli import main

sys.exit(main())
