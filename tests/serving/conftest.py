"""The serving tests: ``deltasync.serving``, the engine-independent receiving side, without an engine.

The node mirror (``test_node_mirror``: versions in shared memory, real leader processes, kill points,
full filesystems), one worker's ``EngineMirror`` over a dict of tensors behind a loader
(``test_engine_mirror``: prepare, commit, undo, tied names), the scatter maps traced from a
stand-in model's loader (``test_scatter``), the prefetcher (``test_prefetch``), the HTTP driver
against a scripted vLLM server (``test_driver``, ``tests/scripted_vllm.py``) and an engine's fleet
reports to a real signal server (``test_fleet_reporter``). Real vLLM engines running this code are
in ``tests/integrations``.

No fixture is defined here. Root fixture: ``node_dir`` (autouse: node mirrors go to a session temp
dir). Helper modules: ``tensors``, ``scripted_vllm``, ``server_harness``.
"""

from __future__ import annotations
