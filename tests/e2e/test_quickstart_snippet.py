"""The quickstart's trainer (docs/quickstart.md, and the same block in the README) runs as written.

The block is read from the page, so the page and this test cannot drift, and the README must show
the very same block. Three things are pointed elsewhere, as a test must: the model id becomes a
tiny Qwen3 saved with ``save_pretrained`` (no download), ``range(100)`` becomes ``range(3)``, the
bucket name a fresh one, and the store gets the fake Hub's ``endpoint=`` (the snippet's default is
the real Hub); the bucket is created by the snippet's own ``create=True`` on the fake Hub (``tests/fakehub.py``: the real huggingface_hub + hf_xet client against a local server,
as the Hub cannot be reached from the tests). The run is then read back bit-exact.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from fakehub import FakeHub  # noqa: E402
from qwen3 import make_qwen3  # noqa: E402

import deltasync as ds  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
_names = itertools.count()


def _trainer_block(text: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    trainers = [b for b in blocks if "ds.DeltaUploader(" in b and "AutoModelForCausalLM" in b]
    assert len(trainers) == 1, f"expected one trainer block, found {len(trainers)}"
    return trainers[0]


def test_the_readme_shows_the_quickstart_trainer() -> None:
    page = _trainer_block((ROOT / "docs" / "quickstart.md").read_text())
    assert page == _trainer_block((ROOT / "README.md").read_text())


def test_the_quickstart_trainer_runs(tmp_path: Path, hf_env: FakeHub) -> None:
    src = _trainer_block((ROOT / "docs" / "quickstart.md").read_text())
    base = tmp_path / "base"
    make_qwen3(seed=0).save_pretrained(base)
    bucket = f"me/quickstart-{next(_names)}"
    for old, new in (
        ('"Qwen/Qwen3-0.6B"', repr(str(base))),
        ("range(100)", "range(3)"),
        ('"me/rl-weights"', repr(bucket)),
        ("create=True)", f"create=True, endpoint={hf_env.endpoint!r})"),
    ):
        assert src.count(old) == 1, old
        src = src.replace(old, new)
    env: dict[str, Any] = {}
    exec(compile(src, "docs/quickstart.md (trainer)", "exec"), env)

    store = ds.HFBucketStore(bucket, "run-1", endpoint=hf_env.endpoint)  # the token: HF_TOKEN, from hf_env
    assert ds.RunReader(store).latest_step() == 2
    served: dict[str, Any] = {}
    assert ds.DeltaFetcher(store, verify="full").sync(served) == 2
    trained = {k: v.to(torch.bfloat16) for k, v in env["model"].state_dict().items()}
    assert served.keys() == trained.keys()
    for name, t in trained.items():
        assert torch.equal(served[name].view(torch.int16), t.view(torch.int16)), name
