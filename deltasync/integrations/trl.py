"""TRL's ``AsyncGRPOTrainer`` on deltasync: each weight sync is a committed step, engines update from the store.

``trl.experimental.async_grpo.AsyncGRPOTrainer(..., weight_transfer=...)`` takes any object with
the methods of TRL's ``WeightTransferProtocol``; :class:`DeltaSyncWeightTransfer` is one::

    from deltasync.integrations.trl import DeltaSyncWeightTransfer

    transfer = DeltaSyncWeightTransfer("hf://buckets/me/run-1", servers=["http://vllm-0:8000"])
    trainer = AsyncGRPOTrainer(model="Qwen/Qwen3-0.6B", ..., weight_transfer=transfer)  # an id or path
    transfer.model = trainer.model  # its frozen parameters join each step
    trainer.train()

TRL 1.16's ``AsyncGRPOTrainer`` takes a model id or path, not a model object. Install with
``pip install -e '.[trl]'`` (TRL's rollout worker needs aiohttp). The servers start from a step of
the store (``deltasync fetch``), so push one first (the starting weights, e.g. with ``delta-upload``)
and start them with ``--served-model-name`` set to the trainer's ``model=``: TRL's worker sends it
as ``"model"``. See docs/trl.md.

At each sync TRL calls ``pause()``, then ``send_weights(iterator)`` on the main process with every
trainable parameter gathered (FSDP2: ``full_tensor()``) in the trainer dtype, then ``resume()``.
Here ``pause()`` does nothing: the servers keep generating while the step is diffed, written and
committed. ``send_weights`` casts each tensor to ``cast_dtype`` (bf16 by default) as it arrives,
adds the model's frozen parameters (TRL skips them, but the run's inventory must hold every
tensor an engine loads), pushes the state as one deltasync step, waits for its commit, then drives
every server through the update sequence of :class:`~deltasync.serving.driver.VLLMDriver`
(pause, four phases with ``weight_version=str(step)``, prefix-cache reset, resume). The engines
never see NCCL: they download the step from the store. ``resume()`` then has nothing left to do.

Bounded staleness: with ``max_staleness=k`` (and ``signal_url=`` among the uploader options),
``send_weights`` returns only once every live replica reporting to the signal server's fleet view
(``deltasync follow``, ``deltasync follow --vllm``, engines with the backend's ``signal`` option,
and the servers this transfer drives) serves step N - k or newer, so the rollouts TRL collects
after a sync come from weights at most ``k`` syncs older than its model version (TRL's own
``max_staleness`` bounds how old the samples it trains on may be; this bounds the engines).
After ``staleness_timeout`` seconds it raises :class:`~deltasync.errors.StalenessTimeout` naming
who is behind.

Behavioural audit (docs/audit.md): with ``references=True`` (or every N syncs), each sync also
attaches the trainer's reference logprobs of the run's probes for its step
(:meth:`DeltaUploader.attach_reference`: one small no-grad forward of ``model``, run while the step
commits, stored before the servers update, so their audit of the step finds it). With
``signal_url``, after each sync the transfer reads the fleet view and records the replicas'
per-version mismatch against those references (``self.audits``); after :meth:`attach`, the figures
also join TRL's own logged metrics as ``deltasync/audit/*`` (mean and max |delta logprob|, the k3
KL estimate, the audited step, the diverged replicas). ``audit=True`` (or a
:class:`~deltasync.serving.audit.AuditConfig`) has the driven servers audited right after each
update (:class:`~deltasync.serving.driver.VLLMDriver`'s ``audit``): their results feed the same
figures without a signal server, and a diverged server is reported (its policy's action taken).

LoRA (docs/lora.md): when the trainer's model is a ``peft.PeftModel`` (TRL's ``peft_config``; call
:meth:`attach`), each sync pushes the active adapter's LoRA tensors only, in the trainer's dtype
(no ``cast_dtype``: bit-exact to the trainer's adapter), and the run's ``adapter_config.json``
once; the merged weights TRL hands ``send_weights`` are drained unread. The user's only change is
``peft_config``. Serving the adapter on vLLM is not driven yet (the servers load full weights).

Steps are numbered by sync: the first sync (TRL's cold sync at train begin) is ``first_step``
(default: the store's newest step + 1, so 1 after a pushed step 0; 0 on an empty store), then one
more per sync.

TRL hands the iterator to the main process only, so the state is gathered there: a sharded push
(every rank pushing its own shards) is not possible through this seam. GRPOTrainer and the other
online trainers have no such seam at all (they always build an NCCL ``VLLMGeneration``); see
docs/trl.md.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from deltasync.errors import DeltaSyncError, SignalError
from deltasync.serving.driver import DriverOptions, FleetReporting, PauseMode, ServerUpdate, VLLMDriver
from deltasync.storage import Store, open_store

if TYPE_CHECKING:
    from concurrent.futures import Future

    import torch

    from deltasync.protocol.audit import AuditReport
    from deltasync.protocol.probes import ProbeSet, Reference
    from deltasync.serving.audit import AuditConfig
    from deltasync.signal import FleetView
    from deltasync.uploader import DeltaUploader

__all__ = ["DeltaSyncWeightTransfer", "SyncRecord", "TransferOptions", "audit_figures", "audit_metrics"]

log = logging.getLogger("deltasync.trl")


@dataclass(frozen=True, slots=True)
class SyncRecord:
    """One TRL weight sync: the step it became and what each server did with it."""

    step: int
    #: seconds from TRL's ``pause()`` to the step's commit in the store
    commit_s: float
    #: seconds from TRL's ``pause()`` to every server serving the step (the whole sync)
    total_s: float
    updates: tuple[ServerUpdate, ...]


@dataclass(frozen=True, slots=True)
class TransferOptions:
    """The options of :class:`DeltaSyncWeightTransfer` (each also a keyword of its constructor).

    cast_dtype: the dtype each tensor is cast to as it arrives. store_url: the URL the *servers* use to
    reach the store (default: the store's own). first_step: the first sync's step (default: the store's
    newest + 1). pause_mode, timeout, api_key: how the servers are updated
    (:class:`~deltasync.serving.driver.DriverOptions`). strict: raise when a server does not serve a
    synced step. max_staleness, staleness_quorum, staleness_timeout, staleness_healthy_only: the
    staleness gate after each sync. references, probes: the trainer-side references. audit: audit the
    driven servers after each update (True, or an ``AuditConfig``).
    """

    cast_dtype: Any = "bfloat16"
    store_url: str | None = None
    first_step: int | None = None
    pause_mode: PauseMode = "wait"
    timeout: float = 600.0
    api_key: str | None = None
    strict: bool = True
    max_staleness: int | None = None
    staleness_quorum: int | float | None = None
    staleness_timeout: float = 600.0
    staleness_healthy_only: bool = False
    references: bool | int = False
    probes: ProbeSet | None = None
    audit: bool | AuditConfig = False

    def __post_init__(self) -> None:
        refs = self.references
        if not isinstance(refs, int) or (not isinstance(refs, bool) and refs < 1):
            raise ValueError(f"references must be a bool or a positive integer (every N syncs), got {refs!r}")
        ms = self.max_staleness
        if ms is not None and (isinstance(ms, bool) or not isinstance(ms, int) or ms < 0):
            raise ValueError(f"max_staleness must be None or an int >= 0, got {ms!r}")

    @classmethod
    def split(cls, base: TransferOptions, keywords: dict[str, Any]) -> tuple[TransferOptions, dict[str, Any]]:
        """``base`` with the keywords that name its fields, and the other keywords (the uploader's)."""
        names = {f.name for f in fields(cls)}
        mine = {k: v for k, v in keywords.items() if k in names}
        return (replace(base, **mine) if mine else base), {k: v for k, v in keywords.items() if k not in names}


class DeltaSyncWeightTransfer:
    """A TRL ``WeightTransferProtocol`` that ships each sync through a deltasync store (see the module doc).

    ``store``: the run's store (URL or Store); ``store_url``: the URL the *servers* use to reach it
    (default: the store's own URL). ``servers``: vLLM server base URLs to drive (none: only commit,
    e.g. when ``deltasync follow --vllm`` runs beside the servers). ``model``: the trained model, whose
    frozen parameters join each step. ``strict``: raise when a server does not serve a synced step
    (its rollouts would come from older weights than TRL believes); False only logs it.
    ``uploader_options`` go to :class:`~deltasync.DeltaUploader` (``anchor_every``, ``signal_url``...);
    with ``signal_url`` the driven servers also report to its fleet view. ``max_staleness``,
    ``staleness_quorum``, ``staleness_timeout``, ``staleness_healthy_only`` (count only ``serving``
    replicas, not ``failed`` or ``diverged`` ones): the staleness gate after each sync (see the module doc;
    :meth:`DeltaUploader.wait_for_replicas`). ``references``, ``probes``: the behavioural audit's
    trainer-side references (see the module doc); call :meth:`attach` with the trainer. ``audit``:
    audit the driven servers after each update (True, or an ``AuditConfig``).
    """

    def __init__(
        self,
        store: Store | str | os.PathLike[str],
        *,
        servers: Sequence[str] = (),
        model: torch.nn.Module | None = None,
        options: TransferOptions | None = None,
        **keywords: Any,
    ) -> None:
        # the documented keywords (``max_staleness=``, ``references=``, ...) are TransferOptions' fields;
        # any other keyword is the uploader's
        opts, uploader_options = TransferOptions.split(options or TransferOptions(), keywords)
        if opts.max_staleness is not None and not uploader_options.get("signal_url"):
            raise ValueError(
                "max_staleness needs signal_url=: the signal server the replicas report to (docs/fleet.md)"
            )
        self.options = opts
        self.reference_every = int(opts.references)
        self.probes = opts.probes
        self.audit: AuditConfig | None = None
        if opts.audit is not False:
            from deltasync.serving.audit import AuditConfig

            self.audit = opts.audit if isinstance(opts.audit, AuditConfig) else AuditConfig(probes=opts.probes)
        #: the audit figures read from the fleet view after each sync: audited step -> metrics (see
        #: :func:`audit_metrics`), in the order they were first seen
        self.audits: dict[int, dict[str, float]] = {}
        #: where the figures join TRL's metrics (TRL's per-key lists; set by :meth:`attach`)
        self.metrics: dict[str, list[Any]] | None = None
        self._syncs = 0
        self.max_staleness = opts.max_staleness
        self.staleness_quorum = opts.staleness_quorum
        self.staleness_timeout = opts.staleness_timeout
        self.staleness_healthy_only = opts.staleness_healthy_only
        self.store = store if isinstance(store, Store) else open_store(store)
        self.servers = list(servers)
        self.model = model
        self.cast_dtype = opts.cast_dtype
        self.store_url = opts.store_url or self.store.url
        self.first_step = opts.first_step
        self.pause_mode: PauseMode = opts.pause_mode
        self.timeout, self.api_key, self.strict = opts.timeout, opts.api_key, opts.strict
        self.uploader_options = uploader_options
        self.uploader: DeltaUploader | None = None
        self.driver: VLLMDriver | None = None
        self.next_step: int | None = None
        #: one record per sync, in order
        self.history: list[SyncRecord] = []
        self._t_pause: float | None = None

    def attach(self, trainer: Any) -> None:
        """Join ``trainer`` (TRL's ``AsyncGRPOTrainer``): its model's frozen parameters go into each step
        (``self.model``; a PEFT model's adapter is pushed instead, see the module doc), its model computes the references, and the audit figures join the metrics
        TRL logs (its ``_metrics["train"]`` lists, where TRL's own weight-sync timings go)."""
        self.model = trainer.model
        metrics = getattr(trainer, "_metrics", None)
        if isinstance(metrics, dict) and isinstance(metrics.get("train"), dict):
            self.metrics = metrics["train"]
        else:
            log.warning("deltasync: %s keeps no TRL metrics dict; the audit figures are only logged", type(trainer))

    # ----------------------------------------------------------- the protocol

    def init_weight_transfer(self) -> None:
        """Open the uploader and point every server's deltasync backend at the store (once)."""
        if self.uploader is not None:
            return
        self._refuse_servers_for_an_adapter()
        from deltasync.uploader import DeltaUploader

        opts = {"distributed": False, **self.uploader_options}  # TRL gathers onto the main process
        self.uploader = DeltaUploader(self.store, **opts)
        head = self.uploader.last_committed_step
        self.next_step = self.first_step if self.first_step is not None else (0 if head is None else head + 1)
        if self.servers:
            signal = self.uploader_options.get("signal_url")
            run = self.uploader_options.get("signal_run") or self.uploader.run_id
            token = self.uploader_options.get("signal_token")
            self.driver = VLLMDriver(
                self.servers,
                self.store_url,
                DriverOptions(pause_mode=self.pause_mode, timeout=self.timeout, api_key=self.api_key),
                reporting=FleetReporting(signal, run, token) if signal and run else None,
                audit=self._audit_source(),
            )
            self.driver.init()

    def pause(self) -> None:
        """Nothing to pause yet: the servers keep generating until the step is committed."""
        self._t_pause = time.perf_counter()

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Commit the gathered weights as the next step, then bring every server to it."""
        if self.uploader is None:
            self.init_weight_transfer()
        assert self.uploader is not None and self.next_step is not None
        t0 = self._t_pause if self._t_pause is not None else time.perf_counter()
        self._t_pause = None
        state = self._adapter_model(iterator)
        if state is None:
            state = self._state(iterator)
        step = self.next_step
        pushed = self.uploader.push(state, step)
        del state
        reference = self._attach_reference(step)  # the forward runs while the step commits
        info = pushed.result()
        if reference is not None:
            try:
                reference.result(self.timeout)
            except (DeltaSyncError, TimeoutError) as exc:
                log.error("deltasync: the reference of step %d was not stored (no divergence for it): %s", step, exc)
        self.next_step = step + 1
        self._syncs += 1
        t_commit = time.perf_counter()
        updates: list[ServerUpdate] = self.driver.update(step) if self.driver is not None else []
        record = SyncRecord(step, t_commit - t0, time.perf_counter() - t0, tuple(updates))
        self.history.append(record)
        log.info(
            "TRL sync -> step %d (%s, %d bytes) committed in %.2f s; servers: %s",
            step,
            info.kind,
            info.nbytes,
            record.commit_s,
            ", ".join(f"{u.url} {u.state} (pause {u.pause_s * 1000:.0f} ms)" for u in updates) or "none",
        )
        bad = [u for u in updates if not u.ok]
        if bad:
            msg = f"step {step} is committed but not served by " + "; ".join(
                f"{u.url} ({u.state}: {u.error})" for u in bad
            )
            if self.strict:
                raise DeltaSyncError(
                    msg + ". Their rollouts would come from older weights than the trainer's model version. "
                    "Fix or restart those servers (DeltaSyncWeightTransfer(strict=False) only logs this)"
                )
            log.warning("%s", msg)
        if self.max_staleness is not None:
            view = self.uploader.wait_for_replicas(
                step,
                max_lag=self.max_staleness,
                quorum=self.staleness_quorum,
                timeout=self.staleness_timeout,
                healthy_only=self.staleness_healthy_only,
            )
            log.info("step %d: %d replicas serve step %d or newer", step, len(view.replicas), step - self.max_staleness)
        self._record_audits(updates)

    # ------------------------------------------------------------------ audit

    def _audit_source(self) -> Any:
        if self.audit is None:
            return None
        from deltasync.serving.audit import AuditSource

        return AuditSource(self.store, self.audit)

    def _attach_reference(self, step: int) -> Future[Reference] | None:
        if not self.reference_every or (self._syncs % self.reference_every):
            return None
        assert self.uploader is not None
        model = self.model
        if model is None:
            if self._syncs == 0:
                log.warning("deltasync: references=... needs the trainer's model: call transfer.attach(trainer)")
            return None
        if any(hasattr(p, "full_tensor") for p in model.parameters()):
            if self._syncs == 0:
                log.warning("deltasync: no references from a sharded (FSDP2) model: its forward is a collective")
            return None
        try:
            return self.uploader.attach_reference(step, model, probes=self.probes)
        except (DeltaSyncError, ValueError) as exc:
            log.error("deltasync: no reference for step %d: %s", step, exc)
            return None

    def _record_audits(self, updates: Sequence[ServerUpdate]) -> None:
        """Record each audited step's figures once: from the fleet view (with a signal server: every
        replica that reports there), else from the driven servers' audits of this sync."""
        assert self.uploader is not None
        found: dict[int, dict[str, float]] = {}
        url = self.uploader_options.get("signal_url")
        if url:
            from deltasync.signal import SignalClient

            run = self.uploader_options.get("signal_run") or self.uploader.run_id
            try:
                with SignalClient(url, self.uploader_options.get("signal_token")) as client:
                    found = audit_metrics(client.fleet(run))
            except SignalError as exc:
                log.debug("deltasync: no fleet view for the audit figures: %s", exc)
        if not found:
            found = audit_figures([(u.audit.report(), u.audit.diverged) for u in updates if u.audit is not None])
        for audited, figures in sorted(found.items()):
            if audited in self.audits:
                continue
            self.audits[audited] = figures
            log.info(
                "deltasync audit of step %d: %s",
                audited,
                ", ".join(f"{k.removeprefix('deltasync/audit/')} {v:.4g}" for k, v in figures.items()),
            )
            if self.metrics is not None:
                for k, v in figures.items():
                    self.metrics.setdefault(k, []).append(v)

    def resume(self) -> None:
        """Nothing left to do: each server was resumed by its update sequence."""

    def destroy(self) -> None:
        """Flush and close the uploader and the driver (train end)."""
        if self.driver is not None:
            self.driver.close()
            self.driver = None
        if self.uploader is not None:
            self.uploader.close()
            self.uploader = None

    # ----------------------------------------------------------------- helpers

    def _adapter_model(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> Any:
        """The trainer's PEFT model when it is one (then its adapter is pushed, not the merged weights TRL
        sends: the iterator is drained unread, as TRL's other ranks drain theirs), else None."""
        from deltasync.run.adapter import is_peft_model

        model = self.model
        if model is None or not is_peft_model(model):
            return None
        for _name, _tensor in iterator:  # merged W + scale * B @ A: every element of every adapted matrix
            pass
        self._refuse_servers_for_an_adapter()
        if any(hasattr(p, "full_tensor") for p in model.parameters() if p.requires_grad):
            raise DeltaSyncError(
                "the PEFT adapter is sharded (DTensors): TRL calls send_weights on the main process only, so it "
                "cannot be gathered here. Keep the adapter out of fully_shard, or train without FSDP"
            )
        return model

    def _refuse_servers_for_an_adapter(self) -> None:
        """Driven servers load full weights only: a PEFT model's run is refused with them (docs/lora.md)."""
        from deltasync.run.adapter import is_peft_model

        if self.servers and self.model is not None and is_peft_model(self.model):
            raise DeltaSyncError(
                "the trainer's model is a PEFT model (an adapter run) and this transfer drives vLLM servers, which "
                "it cannot bring to an adapter yet (docs/lora.md): use DeltaSyncWeightTransfer(servers=()) and load "
                "the adapter dir `deltasync follow --out DIR` writes"
            )

    def _state(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        import torch

        dtype = getattr(torch, self.cast_dtype) if isinstance(self.cast_dtype, str) else self.cast_dtype
        state: dict[str, torch.Tensor] = {}
        for name, t in iterator:  # TRL frees each gathered tensor when the iterator advances: copy it now
            state[name] = t.detach().to(device="cpu", dtype=dtype, copy=True)
        if self.model is not None:
            for name, p in self.model.named_parameters():
                key = checkpoint_name(name)
                if p.requires_grad or key in state:
                    continue
                if hasattr(p, "full_tensor"):  # gathering is a collective, and only this process is called
                    raise DeltaSyncError(
                        f"frozen parameter {key} is sharded (a DTensor): TRL calls send_weights on the main process "
                        "only, so it cannot be gathered here. Keep frozen parameters out of fully_shard, or unfreeze "
                        "them"
                    )
                state[key] = p.detach().to(device="cpu", dtype=dtype, copy=True)
        if not state:
            raise DeltaSyncError("TRL sent no weights (an empty iterator): nothing to commit")
        return state


def checkpoint_name(name: str) -> str:
    """A parameter's checkpoint name, cleaned as TRL cleans the names it sends (DDP/FSDP wrappers,
    activation checkpointing)."""
    return name.removeprefix("module.").replace("_checkpoint_wrapped_module.", "")


def audit_metrics(view: FleetView) -> dict[int, dict[str, float]]:
    """The fleet's audit figures per audited step (:func:`audit_figures` of every replica that reported
    an audit, ``diverged`` as the fleet shows it)."""
    return audit_figures([(r.audit, r.state == "diverged") for r in view.replicas if r.audit is not None])


def audit_figures(audits: Sequence[tuple[AuditReport, bool]]) -> dict[int, dict[str, float]]:
    """Audit figures per audited step from (report, diverged) pairs: over the reports with a divergence
    against the trainer's reference of that step, ``deltasync/audit/mismatch_mean_abs`` (the mean of
    their mean |delta logprob|), ``deltasync/audit/mismatch_max_abs`` (the largest),
    ``deltasync/audit/kl`` (the mean k3 estimate); over every report of that step,
    ``deltasync/audit/replicas`` and ``deltasync/audit/diverged`` (how many are diverged)."""
    by_step: dict[int, list[tuple[AuditReport, bool]]] = {}
    for report, diverged in audits:
        by_step.setdefault(report.audited_step, []).append((report, diverged))
    out: dict[int, dict[str, float]] = {}
    for step, reports in by_step.items():
        divs = [r.divergence for r, _ in reports if r.divergence is not None]
        figures: dict[str, float] = {
            "deltasync/audit/replicas": float(len(reports)),
            "deltasync/audit/diverged": float(sum(d for _, d in reports)),
        }
        if divs:
            figures["deltasync/audit/mismatch_mean_abs"] = sum(d.mean_abs for d in divs) / len(divs)
            figures["deltasync/audit/mismatch_max_abs"] = max(d.max_abs for d in divs)
            figures["deltasync/audit/kl"] = sum(d.kl for d in divs) / len(divs)
        out[step] = figures
    return out
