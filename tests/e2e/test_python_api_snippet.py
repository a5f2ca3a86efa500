"""The "Python API" page's snippet (docs/python-api.md) runs as written (issue 15: it once lacked ``import torch`` and
said ``sync`` returns the target). Only the names the snippet leaves to the reader are supplied:
``model``, ``num_steps`` and ``train_step``, and the store path is pointed at a temporary dir."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

PAGE = Path(__file__).resolve().parents[2] / "docs" / "python-api.md"


def _snippet() -> tuple[str, str]:
    text = PAGE.read_text()
    section = text[text.index("# Python API") :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "no python block under '# Python API' in docs/python-api.md"
    body = code.group(1)
    trainer, _, inference = body.partition("# inference side")
    assert inference, "the snippet no longer has an inference side"
    return trainer, "# inference side" + inference


def test_the_python_api_snippet_runs(tmp_path: Path) -> None:
    trainer_src, inference_src = _snippet()
    assert "import torch" in trainer_src and "import deltasync as ds" in trainer_src
    assert 'ds.open_store("file:///data/run-1")' in trainer_src
    store_url = (tmp_path / "run-1").as_uri()
    trainer_src = trainer_src.replace("file:///data/run-1", store_url)
    inference_src = inference_src.replace('"out/"', repr(str(tmp_path / "out")))

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 64))
    g = torch.Generator().manual_seed(1)
    trainer: dict[str, Any] = {"model": model, "num_steps": 10}

    def train_step() -> None:  # an RL-sized update: a few weights move (a dense one would anchor every step)
        if "fut" in trainer:  # a real step takes seconds; here the previous push must land first, or
            trainer["fut"].result()  # the uploader folds a backlog into one step ("coalesce") and 7 may be skipped
        with torch.no_grad():
            for p in model.parameters():
                idx = torch.randint(0, p.numel(), (3,), generator=g)
                p.view(-1)[idx] += 0.05

    trainer["train_step"] = train_step
    exec(compile(trainer_src, "docs/python-api.md (trainer side)", "exec"), trainer)

    # another process would build its own model: the same shapes, in the run's dtype (bf16)
    served = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 64)).to(torch.bfloat16)
    inference: dict[str, Any] = {**{k: trainer[k] for k in ("ds", "torch", "store")}, "model": served}
    src = inference_src.replace("fetcher.sync(model, step=7)", "at7 = fetcher.sync(model, step=7)")
    src = src.replace("fetcher.sync(model)  ", "latest = fetcher.sync(model)  ")
    exec(compile(src, "docs/python-api.md (inference side)", "exec"), inference)

    assert inference["latest"] == 9 and inference["at7"] == 7
    weights = inference["weights"]
    want = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    assert sorted(weights) == sorted(want)
    assert all(torch.equal(weights[k], want[k]) for k in want)  # the empty dict holds the latest step
    assert (tmp_path / "out" / "model.safetensors").exists() or any((tmp_path / "out").glob("*.safetensors"))
