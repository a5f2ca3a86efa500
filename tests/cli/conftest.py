"""The CLI tests: ``deltasync.cli`` (``delta-upload``, ``deltasync fetch``/``follow``/``inspect``/``gc``/...).

The area covers the commands as a user runs them (real processes): read-only commands never write,
error messages, ``--help`` of every command and option, the CLI against the S3 test server, ``gc``,
``delta-upload watch``, and the signal server's three-terminal quickstart as docs/signal-server.md prints it.

No fixture is shared by more than one module here: each module keeps its own. Root fixture used:
``s3_server`` (test_cli_s3). Helper modules: ``cli_process`` (CLI subprocesses), ``server_harness``
(a signal server on loopback), ``gc_support``, ``qwen3``, ``tensors``.
"""

from __future__ import annotations
