"""One engine worker's side: its view of the node mirror (``mirror``: prepare, commit, undo), the
writes of only the changed elements into the engine's parameters (``scatter``), the registration of
the mirror's pages with CUDA (``pinning``) and the background preparation of new steps (``prefetch``).
Imports nothing itself."""
