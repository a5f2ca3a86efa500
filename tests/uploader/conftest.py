"""The uploader tests: ``deltasync.uploader`` (DeltaUploader, its commit writes, spans, sharded push).

The area covers push never waiting for the store, the bounded backlog, commit kinds and failures,
the retry of commit writes, resume after a crash, what the uploader keeps in memory, spans, two
writers racing for one step, and sharded push from real multi-process ``torch.distributed``
groups (``tests/sharded_worker.py``).

No fixture is shared by more than one module here: each module's fixtures stay in it
(``spy_store`` in test_uploader). Root fixtures used: ``fake_hub`` and ``hf_bucket``
(test_writer_race). Helper modules: ``spy_store`` (SpyStore), ``tensors`` (bit-exact checks),
``fakehub`` (HF stores on the fake Hub).
"""

from __future__ import annotations
