"""The run tests: ``deltasync.run`` (RunReader, claims, garbage collection, ``inspect --verify``).

The area covers gc against real stores (deterministic races: a step deleted mid-sync, a lease or a
commit while gc plans) and ``deltasync inspect --verify`` as a user runs it on a run written by
the real uploader.

No fixture is shared by more than one module here: each module keeps its own. Root fixtures used:
``s3_server``, ``fake_hub`` (test_gc). Helper modules: ``gc_support``, ``fakehub``, ``cli_process``.
"""

from __future__ import annotations
