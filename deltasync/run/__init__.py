"""Run-level logic over a store: the one run reader, writer claims, garbage collection and the audit.

A *run* is the set of objects one uploader chain writes under a store's root (``steps/``, ``HEAD.json``,
``writers/``, ``leases/``, and for the behavioural audit ``probes.json`` and ``references/``). :mod:`deltasync.storage` knows objects; this package knows runs.
"""

from __future__ import annotations

from deltasync.run.probes import default_probes, read_probes, read_reference, write_probes, write_reference
from deltasync.run.reader import RunReader, get_present

__all__ = [
    "RunReader",
    "default_probes",
    "get_present",
    "read_probes",
    "read_reference",
    "write_probes",
    "write_reference",
]
