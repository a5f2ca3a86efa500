"""The package tests: ``deltasync`` as a whole, read from its source and its public surface.

The area covers the public API (``deltasync.__all__`` pinned name by name), the exception tree,
the import graph (no import circles) and the import layering of DESIGN.md.

No fixture is defined here and none of the root ones or of the helper modules is used.
"""

from __future__ import annotations
