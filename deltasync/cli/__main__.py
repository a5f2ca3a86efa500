"""``python -m deltasync.cli``: the ``deltasync`` command."""

from __future__ import annotations

import sys

from deltasync.cli.main import main

sys.exit(main())
