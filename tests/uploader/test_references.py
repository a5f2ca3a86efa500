"""DeltaUploader.probes / attach_reference: the run's probe set is stored once (derived from the pushed
inventory by default), references are written in the background as write-once objects beside the
steps (never in a step's folder), a model's reference is its own forward, and bad input is refused
before anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import deltasync as ds
from deltasync.errors import AlreadyExists, ProtocolError
from deltasync.protocol.probes import ProbeSet
from deltasync.run.probes import default_probes, read_probes, read_reference

VOCAB = 50


class TinyLM(torch.nn.Module):
    """A real causal LM in miniature: embedding, one linear layer, logits over the vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed_tokens = torch.nn.Embedding(VOCAB, 8)
        self.proj = torch.nn.Linear(8, VOCAB)
        with torch.no_grad():
            self.embed_tokens.weight.copy_(torch.randn(VOCAB, 8, generator=g))
            self.proj.weight.copy_(torch.randn(VOCAB, 8, generator=g))

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.proj(torch.cumsum(self.embed_tokens(input_ids), dim=1)),)


def test_a_reference_is_the_models_own_logprobs_written_once_beside_the_steps(tmp_path: Path) -> None:
    store = ds.open_store(tmp_path / "run")
    model = TinyLM()
    with ds.DeltaUploader(store) as up:
        with pytest.raises(ValueError, match="push a step first"):
            up.probes()
        up.push(model.state_dict(), 0).result()
        probes = up.probes()
        assert probes == default_probes(VOCAB, up.run_id) and read_probes(store) == probes
        ref = up.attach_reference(0, model).result(30)
        # by hand: log_softmax of the logits at each position, picked at the next token
        ids = torch.tensor(probes.tokens)
        want = torch.log_softmax(model(ids)[0][:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        assert ref.logprobs == tuple(tuple(r) for r in want.tolist())
        assert ref.dtype == "float32" and read_reference(store, 0) == ref
        # logprobs computed elsewhere (e.g. by the trainer's own loss pass) work the same
        same = [list(r) for r in ref.logprobs]
        assert up.attach_reference(0, same, dtype="float32").result(30) == ref  # the same object again: fine
        with pytest.raises(AlreadyExists, match="step 0"):
            up.attach_reference(0, [[v - 1 for v in r] for r in ref.logprobs], dtype="float32").result(30)
        with pytest.raises(ProtocolError, match="probe 0 has 3 logprobs"):
            up.attach_reference(1, [[-1.0] * 3] * len(probes.tokens))
        with pytest.raises(ProtocolError, match="step"):
            up.attach_reference(-1, model)
        with pytest.raises(AlreadyExists, match="different probe set"):
            up.attach_reference(1, model, probes=default_probes(VOCAB, "another run"))
    keys = sorted(o.key for o in store.list(""))
    assert "references/000000000000.json" in keys and "probes.json" in keys
    assert not [k for k in keys if k.startswith("steps/") and "reference" in k]
    with pytest.raises(RuntimeError, match="closed"):
        up.attach_reference(0, model)


def test_given_probes_are_stored_and_used(tmp_path: Path) -> None:
    store = ds.open_store(tmp_path / "run")
    probes = ProbeSet(((1, 2, 3, 4, 5, 6), (7, 8, 9, 10, 11)), VOCAB)  # two lengths: two forwards
    model = TinyLM()
    with ds.DeltaUploader(store) as up:
        ref = up.attach_reference(3, model, probes=probes).result(30)  # nothing pushed: the given set is enough
        assert up.probes() == probes and [len(r) for r in ref.logprobs] == [5, 4]
        up.flush(30)
    assert read_reference(store, 3) == ref
