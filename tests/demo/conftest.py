"""The demo tests: ``deltasync demo`` (``deltasync/cli/demo.py``) and the Space in ``spaces_demo/``.

The area covers the demo's pieces in-process, ``deltasync demo`` as a real process serving HTTP, the
page in a headless Chromium (Playwright), the Docker Space (Dockerfile, entrypoint, card) and the
Space image built and run (opt-in, ``DELTASYNC_TEST_DOCKER=1``).

No fixture is shared by more than one module here: each module keeps its own. No root fixture is
used. Helper module: ``demo_process`` (a demo process and its HTTP).
"""

from __future__ import annotations
