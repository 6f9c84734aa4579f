"""``python -m proxy`` runs the ``llm-qos`` command line."""

from .cli import main

raise SystemExit(main())
