"""The signal tests: ``deltasync.signal`` (StepWatcher: store polling, the SSE stream, reconnect backoff).

No fixture is defined here, and no root fixture or helper module is used.
"""

from __future__ import annotations
