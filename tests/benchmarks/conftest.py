"""The smoke tests of the benchmark scripts in ``benchmarks/`` (not benchmarks themselves).

Each module imports one script as a module through ``bench_loader.load_bench`` and runs it on a
tiny Qwen3, so that CI notices when a script no longer runs against the current API.

No fixture is shared here: each module has its own ``bench`` fixture, because each loads a
different script (``bench_payload``, ``bench_backends``, ``bench_hf``, ``bench_scale``); they share the loader,
not the fixture. Root fixtures used: ``s3_server`` (test_bench_backends_smoke), ``fake_hub``
(test_bench_hf_smoke). Helper modules: ``bench_loader``, ``fakehub``.
"""

from __future__ import annotations
