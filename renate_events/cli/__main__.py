"""``python -m renate_events.cli``: the ``renate-events`` command."""

import sys

from renate_events.cli import main

sys.exit(main())
