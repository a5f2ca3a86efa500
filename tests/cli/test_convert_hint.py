"""The "not a safetensors file" advice works, tied weights included.

The advice once was ``safetensors.torch.save_file(torch.load(path), ...)``, which refuses a model with
tied weights (Qwen3-0.6B's embeddings and lm_head): "Some tensors share memory". It now names
``save_pretrained`` and ``safetensors.torch.save_model``; here the advice is followed on a tied model
and deltasync reads the result.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors.torch")

import safetensors.torch as st  # noqa: E402
import torch  # noqa: E402

from deltasync._util.checkpoint_io import CONVERT_HINT, load_checkpoint  # noqa: E402
from deltasync.errors import ObjectNotFound, ProtocolError  # noqa: E402


class Tied(torch.nn.Module):
    """An embedding and an output head sharing one weight, as tied language models do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight


def test_a_torch_save_file_gets_advice_that_works_on_a_tied_model(tmp_path: Path) -> None:
    model = Tied()
    torch.save(model.state_dict(), tmp_path / "model.bin")
    with pytest.raises(ProtocolError) as err:
        load_checkpoint(tmp_path / "model.bin")
    msg = str(err.value)
    assert "not a safetensors file" in msg and msg.endswith(CONVERT_HINT)
    assert "save_pretrained" in msg and "safetensors.torch.save_model(model, 'model.safetensors')" in msg
    # the old advice fails on this model; the new one writes a checkpoint deltasync reads
    with pytest.raises(RuntimeError, match="share memory"):
        st.save_file(torch.load(tmp_path / "model.bin"), str(tmp_path / "old.safetensors"))
    st.save_model(model, str(tmp_path / "model.safetensors"))
    got = load_checkpoint(tmp_path / "model.safetensors")
    assert torch.equal(next(iter(got.values())), model.embed.weight.detach())


def test_a_dir_of_bin_files_gets_the_same_advice(tmp_path: Path) -> None:
    torch.save(Tied().state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ObjectNotFound, match="pytorch_model.bin, not safetensors") as err:
        load_checkpoint(tmp_path)
    assert str(err.value).endswith(CONVERT_HINT)
