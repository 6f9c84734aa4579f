"""``python -m engine_server``: see :mod:`engine_server.main`."""

import sys

from .main import main

sys.exit(main())
