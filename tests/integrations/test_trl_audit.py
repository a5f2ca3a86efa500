"""DeltaSyncWeightTransfer's audit side (docs/audit.md): with ``references=N`` each N-th sync stores the
trainer's reference logprobs of the run's probes, computed by the attached model; with a real signal
server (127.0.0.1) the replicas' reported audits become per-version figures (``self.audits``) appended
to the metrics TRL logs. The replicas are FleetReporters standing in for engines (the engines' own
audits are test_vllm_faults' and the TRL page's test); TRL itself is not needed: the transfer is called
as TRL calls it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_harness import ThreadServer

from deltasync import open_store
from deltasync.integrations.trl import DeltaSyncWeightTransfer, audit_metrics
from deltasync.protocol.audit import AuditReport, Divergence, fingerprint
from deltasync.run.probes import list_references, read_probes, read_reference
from deltasync.server import Settings, create_app
from deltasync.signal import FleetReporter, SignalClient

torch = pytest.importorskip("torch")
TOKEN = "publish-token-trl-audit"
WAIT = 60.0
VOCAB = 40


class TinyLM(torch.nn.Module):
    """A causal LM in miniature (embedding -> running sum -> logits), trained by the test between syncs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> Any:
        return (self.head(torch.cumsum(self.embed_tokens(input_ids), dim=1)),)


def sync(transfer: DeltaSyncWeightTransfer, model: TinyLM) -> None:
    def params() -> Iterator[tuple[str, torch.Tensor]]:
        yield from ((n, p.detach()) for n, p in model.named_parameters())

    transfer.pause()
    transfer.send_weights(params())
    transfer.resume()


def test_references_every_n_syncs_and_the_fleets_figures_join_the_metrics(tmp_path: Path) -> None:
    model = TinyLM()
    with ThreadServer(create_app(Settings(publish_token=TOKEN))) as signal:
        transfer = DeltaSyncWeightTransfer(
            tmp_path / "run", references=2, signal_url=signal.url, signal_token=TOKEN, signal_run="trl", run_id="trl"
        )
        transfer.model, transfer.metrics = model, {"perf/weight_sync_s": [0.1]}  # what attach(trainer) sets
        sync(transfer, model)  # step 0: a reference (syncs 0, 2, ...)
        with torch.no_grad():
            model.head.weight.add_(0.5)
        sync(transfer, model)  # step 1: none
        probes = read_probes(open_store(tmp_path / "run"))
        assert probes is not None
        ref0 = read_reference(open_store(tmp_path / "run"), 0)
        assert ref0 is not None and ref0.dtype == "float32"
        with (
            FleetReporter(signal.url, "trl", TOKEN, replica="e0") as e0,
            FleetReporter(signal.url, "trl", TOKEN, replica="e1") as e1,
        ):
            fp = fingerprint(probes.digest, ref0.logprobs)
            e0.update(0, audit=AuditReport(0, fp, Divergence(0.01, 0.1, 0.001)))
            e1.update(0, "diverged", audit=AuditReport(0, fp, Divergence(0.03, 2.5, 0.004)))
            assert e0.wait_reported(WAIT) and e1.wait_reported(WAIT)
            sync(transfer, model)  # step 2: a reference; the fleet's audits of step 0 are recorded
            sync(transfer, model)  # the same audits again: recorded once
        transfer.destroy()
    assert list_references(open_store(tmp_path / "run")) == [0, 2]
    want = {
        "deltasync/audit/replicas": 2.0,
        "deltasync/audit/diverged": 1.0,
        "deltasync/audit/mismatch_mean_abs": pytest.approx(0.02),
        "deltasync/audit/mismatch_max_abs": 2.5,
        "deltasync/audit/kl": pytest.approx(0.0025),
    }
    assert transfer.audits == {0: want}
    assert transfer.metrics["perf/weight_sync_s"] == [0.1]  # TRL's own figures untouched
    assert {k: v for k, v in transfer.metrics.items() if k.startswith("deltasync/")} == {
        k: [v] for k, v in want.items()
    }


def test_audit_metrics_of_a_fleet_without_divergences_count_replicas_only(tmp_path: Path) -> None:
    with ThreadServer(create_app(Settings(publish_token=TOKEN))) as signal:
        fp = fingerprint("ab" * 16, [[-3.0] * 4])
        with (
            FleetReporter(signal.url, "r", TOKEN, replica="a") as a,
            FleetReporter(signal.url, "r", TOKEN, replica="b") as b,
        ):
            a.update(5, audit=AuditReport(5, fp))
            b.update(4)
            assert a.wait_reported(WAIT) and b.wait_reported(WAIT)
            with SignalClient(signal.url, TOKEN) as client:
                view = client.fleet("r")
    assert audit_metrics(view) == {5: {"deltasync/audit/replicas": 1.0, "deltasync/audit/diverged": 0.0}}


def test_references_need_a_positive_every(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="references"):
        DeltaSyncWeightTransfer(tmp_path / "run", references=0)


def test_audit_figures_per_audited_step() -> None:
    from deltasync.integrations.trl import audit_figures

    fp = fingerprint("ab" * 16, [[-3.0] * 4])
    figures = audit_figures(
        [
            (AuditReport(3, fp, Divergence(0.01, 0.1, 0.002)), False),
            (AuditReport(3, fp, Divergence(0.03, 0.5, 0.004)), True),
            (AuditReport(3, fp), False),  # no reference: counted, no mismatch
            (AuditReport(2, fp), False),
        ]
    )
    assert figures[2] == {"deltasync/audit/replicas": 1.0, "deltasync/audit/diverged": 0.0}
    assert figures[3] == {
        "deltasync/audit/replicas": 3.0,
        "deltasync/audit/diverged": 1.0,
        "deltasync/audit/mismatch_mean_abs": pytest.approx(0.02),
        "deltasync/audit/mismatch_max_abs": 0.5,
        "deltasync/audit/kl": pytest.approx(0.003),
    }
    assert audit_figures([]) == {}


def test_the_staleness_gate_can_count_only_healthy_replicas(tmp_path: Path) -> None:
    from deltasync.errors import StalenessTimeout

    model = TinyLM()
    with ThreadServer(create_app(Settings(publish_token=TOKEN))) as signal:
        opts: dict[str, Any] = dict(signal_url=signal.url, signal_token=TOKEN, signal_run="trl", run_id="trl")
        transfer = DeltaSyncWeightTransfer(
            tmp_path / "run", max_staleness=1, staleness_timeout=0, staleness_healthy_only=True, **opts
        )
        fp = fingerprint("ab" * 16, [[-3.0] * 4])
        with FleetReporter(signal.url, "trl", TOKEN, replica="e0") as e0:
            e0.update(0, "diverged", audit=AuditReport(0, fp, Divergence(1.0, 5.0, 1.0)))
            assert e0.wait_reported(WAIT)
            with pytest.raises(StalenessTimeout, match="e0: step 0, lag 0, state diverged"):
                sync(transfer, model)  # step 0: e0 holds it, but diverged
            e0.update(0, audit=AuditReport(0, fp, Divergence(0.001, 0.01, 0.0)))
            assert e0.wait_reported(WAIT)
            sync(transfer, model)  # step 1: e0 healthy at step 0, at most one behind
        transfer.destroy()
    assert [r.step for r in transfer.history] == [0, 1]
