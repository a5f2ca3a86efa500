"""The signal tests: ``deltasync.signal`` (StepWatcher: store polling, the SSE stream, reconnect backoff).

The fleet tests (test_fleet) start a real signal server with the `server_harness` helper module; no
fixture is defined here and no root fixture is used.
"""

from __future__ import annotations
