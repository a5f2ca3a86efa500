"""Fixtures of the protocol tests: ``deltasync.protocol``, the pure wire format without I/O.

The area covers the patch encodings and their compiled kernels, the patch-file layout, the
manifests, the chain and span planners, the retention planner, fuzzed readers and the golden
bytes of protocol v1.

Fixture defined here:

* ``kernel_backend`` (module scope, parametrised ``numba`` / ``numpy``): runs the module's tests
  once on the compiled kernels and once on the numpy fallback. A module opts in with
  ``pytestmark = pytest.mark.usefixtures("kernel_backend")`` (test_protocol_encoding,
  test_protocol_golden); it is not autouse, so the other modules run once.

No root fixture is used. Helper modules: ``manifests`` (a valid anchor manifest without an
uploader) and ``kernel_streams`` (the change streams test_kernels compares the kernels on).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from deltasync.protocol import kernels


@pytest.fixture(scope="module", params=["numba", "numpy"])
def kernel_backend(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test of the module runs on the compiled kernels and on the numpy fallback."""
    with kernels.using(request.param):
        yield
