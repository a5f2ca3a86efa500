"""A ``transformers`` ``TrainerCallback`` that pushes the model's weights at each optimizer step.

Works with ``transformers.Trainer`` and the TRL trainers built on it::

    from deltasync.integrations.transformers import DeltaSyncCallback

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[DeltaSyncCallback("s3://bucket/run-1")])

The only module of deltasync that imports ``transformers``.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

from deltasync.errors import DeltaSyncError, WriterFenced
from deltasync.run.adapter import is_peft_model

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from deltasync.protocol.probes import ProbeSet, Reference
    from deltasync.storage import Store
    from deltasync.uploader import CommitInfo, DeltaUploader

__all__ = ["DeltaSyncCallback"]

log = logging.getLogger("deltasync.integrations.transformers")


class DeltaSyncCallback(TrainerCallback):
    """Push the trained model's weights through a :class:`deltasync.DeltaUploader` every ``every`` steps.

    ``store`` is a store or its URL; ``uploader_options`` are DeltaUploader keyword
    options (``anchor_every``, ``cast_dtype``, ``signal_url``, ...). Pushing never
    waits for the store: results are logged as they resolve (``self.results``,
    ``self.errors``); a failed commit makes the next push an anchor. The final
    state is pushed and everything flushed at ``on_train_end``.

    Folded steps: when the store falls behind (``max_pending`` steps waiting), a new
    step is folded into the newest waiting one (the uploader's ``on_backlog="coalesce"``)
    so that training never waits: steps 6-9 may be committed as part of step 10, and no
    engine can then be updated to exactly step 7. The uploader logs the first folded step
    as a warning (later ones at DEBUG) and counts them (``DeltaUploader.folded``); each is
    also listed in ``self.folded``. ``keep_every_step=True`` commits
    every step instead (``on_backlog="block"``): a push then waits for the store
    whenever ``max_pending`` steps are already waiting.

    Distributed: with replicated weights (DDP) only the world's main process
    pushes; with DTensor state dicts (FSDP2) every rank pushes its own shard
    (DeltaUploader's multi-rank push). FSDP1 and DeepSpeed ZeRO-3 (whose
    ``state_dict()`` is a collective or holds no weights) are refused.

    LoRA: when the trained model is a ``peft.PeftModel``, its active adapter's LoRA tensors are pushed
    (not merged weights) with the run's ``adapter_config.json`` (docs/lora.md).

    Resuming: when the Trainer resumes from a checkpoint whose step is the store's
    newest, the restored weights are proven equal to it (digests) and the chain
    goes on with patches; otherwise the next push is an anchor. When the store is
    ahead of the checkpoint, steps up to the store's head are not pushed (a warning
    says so): committed steps are never rewritten.

    References (docs/audit.md): with ``references=N`` (``True``: every pushed step), each pushed
    step whose number is a multiple of N also gets the trainer's reference logprobs of the run's probes
    (:meth:`DeltaUploader.attach_reference`: one small no-grad forward of the model right after the
    push, written in the background), which receivers compare their engines with. ``probes`` sets
    the run's probe set (default: derived from the run). Stored references are listed in
    ``self.references``; a failed one is logged and listed in ``self.errors``, never raised. Only
    the process that pushes replicated weights computes them (not under FSDP2).
    """

    def __init__(
        self,
        store: Store | str,
        *,
        every: int = 1,
        keep_every_step: bool = False,
        references: bool | int = False,
        probes: ProbeSet | None = None,
        **uploader_options: Any,
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive integer, got {every!r}")
        if not isinstance(references, int) or (not isinstance(references, bool) and references < 1):
            raise ValueError(
                f"references must be a bool or a positive integer (every N pushed steps), got {references!r}"
            )
        self.reference_every = int(references)  # 0: none; True is 1
        if keep_every_step:
            if uploader_options.get("on_backlog", "block") != "block":
                raise ValueError(
                    f"keep_every_step=True commits every step (on_backlog='block'); it contradicts "
                    f"on_backlog={uploader_options['on_backlog']!r}"
                )
            uploader_options["on_backlog"] = "block"
        self.store = store
        self.every = every
        self.uploader_options = uploader_options
        self.uploader: DeltaUploader | None = None
        self.results: list[CommitInfo] = []
        self.errors: list[BaseException] = []
        #: steps folded into a later one (committed only as part of it), in the order they resolved
        self.folded: list[CommitInfo] = []
        #: references stored (attach_reference), in the order they were written
        self.references: list[Reference] = []
        self.probes = probes
        self._sharded = False
        self._lock = threading.Lock()
        self._skip_until: int | None = None
        self._last_pushed: int | None = None
        self._stopped = False

    # --------------------------------------------------------------- events

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Decide whether this rank pushes; resume the chain from the store's head when the Trainer resumed."""
        model = _unwrap(kwargs.get("model"))
        if model is None:
            raise DeltaSyncError("DeltaSyncCallback: the Trainer passed no model to on_train_begin")
        _refuse_unsupported(model)
        weights = model.state_dict()
        sharded = _has_dtensors(weights)
        if not (state.is_world_process_zero or sharded):
            return  # replicated weights: the main process pushes them
        from deltasync.uploader import DeltaUploader

        self._stopped, self._skip_until, self._last_pushed = False, None, None
        options = dict(self.uploader_options)
        # replicated weights: the main process pushes alone, so its uploader must not wait for the other
        # ranks (a multi-rank uploader's constructor is a collective); DTensor shards: every rank pushes
        options.setdefault("distributed", sharded)
        self._sharded = sharded
        self.uploader = up = DeltaUploader(self.store, **options)
        head, step = up.last_committed_step, state.global_step
        if head is None or step > head:
            return  # a new run, or the store is behind the checkpoint: the first push is an anchor
        if step < head:
            self._skip_until = head
            log.warning(
                "the store %s is ahead of this training run: it holds step %d, the Trainer starts at step %d; "
                "steps up to %d are not pushed (committed steps are never rewritten), the first push after it is "
                "an anchor. Use a new store prefix to keep every re-trained step.",
                up.store.url,
                head,
                step,
                head,
            )
            return
        if up.resume(model if is_peft_model(model) else weights, step):
            log.info(
                "deltasync: resumed at step %d of %s (proven by digests); pushes go on as patches", step, up.store.url
            )
        else:
            log.warning(
                "deltasync: the resumed weights differ from step %d in the store; the next push is an anchor", step
            )
        self._last_pushed = step

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Push the weights every ``every`` optimizer steps (returns as soon as they are copied out; with
        ``keep_every_step``, first waits for the store while ``max_pending`` steps are waiting for it)."""
        if state.global_step % self.every == 0:
            self._push(kwargs.get("model"), state.global_step)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Push the final weights if they were not pushed yet, then wait for every commit."""
        up = self.uploader
        if up is None:
            return
        self._push(kwargs.get("model"), state.global_step)
        try:
            up.close()
        finally:
            self.uploader = None
        log.info(
            "deltasync: %d steps committed to %s, %d folded into later steps, %d errors",
            len(self.results) - len(self.folded),
            up.store.url,
            len(self.folded),
            len(self.errors),
        )

    # --------------------------------------------------------------- pushes

    def _push(self, model: Any, step: int) -> None:
        up = self.uploader
        if up is None or self._stopped or (self._last_pushed is not None and step <= self._last_pushed):
            return
        if self._skip_until is not None and step <= self._skip_until:
            return
        try:
            target = _unwrap(model)
            # a PEFT model: the uploader pushes its active adapter (docs/lora.md), not a state dict
            fut = up.push(target if is_peft_model(target) else target.state_dict(), step)
        except DeltaSyncError as exc:
            self._failed(step, exc)
            return
        self._last_pushed = step
        fut.add_done_callback(lambda f: self._resolved(step, f))
        if self.reference_every and not self._sharded and step % self.reference_every == 0:
            self._attach_reference(up, model, step)

    def _attach_reference(self, up: DeltaUploader, model: Any, step: int) -> None:
        try:
            ref = up.attach_reference(step, _unwrap(model), probes=self.probes)
        except (DeltaSyncError, ValueError) as exc:
            with self._lock:
                self.errors.append(exc)
            log.error("deltasync: no reference for step %d: %s", step, exc)
            return

        def stored(f: Future[Reference]) -> None:
            exc = f.exception()
            with self._lock:
                if exc is None:
                    self.references.append(f.result())
                else:
                    self.errors.append(exc)
            if exc is not None:
                log.error("deltasync: the reference of step %d was not stored: %s", step, exc)

        ref.add_done_callback(stored)

    def _resolved(self, step: int, fut: Future[CommitInfo]) -> None:
        exc = fut.exception()
        if exc is not None:
            self._failed(step, exc)
            return
        info = fut.result()
        with self._lock:
            self.results.append(info)
            if info.folded:  # the uploader has logged it (a warning the first time) and counted it
                self.folded.append(info)
        if info.folded:
            return
        log.info(
            "deltasync: step %d %s, %d bytes, %.3f%% changed",
            info.step,
            info.kind,
            info.nbytes,
            100 * info.changed / max(info.total, 1),
        )

    def _failed(self, step: int, exc: BaseException) -> None:
        with self._lock:
            self.errors.append(exc)
        if isinstance(exc, WriterFenced):
            self._stopped = True
            log.error("deltasync: another uploader took over the run; this trainer stops pushing: %s", exc)
        else:
            log.error("deltasync: step %d was not committed (the next push is an anchor): %s", step, exc)


def _unwrap(model: Any) -> Any:
    """The model inside DDP / DataParallel / compile wrappers (accelerate's unwrapping when available)."""
    if model is None:
        return None
    try:
        from accelerate.utils import extract_model_from_parallel

        return extract_model_from_parallel(model, keep_fp32_wrapper=True)
    except ImportError:
        while hasattr(model, "module") and type(model).__name__ in ("DistributedDataParallel", "DataParallel"):
            model = model.module
        return model


def _has_dtensors(state: dict[str, Any]) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return any(isinstance(v, DTensor) for v in state.values())


def _refuse_unsupported(model: Any) -> None:
    name = type(model).__name__
    if name == "FullyShardedDataParallel":
        raise DeltaSyncError(
            "DeltaSyncCallback: FSDP1 (FullyShardedDataParallel) is not supported: its state_dict() is a collective "
            "that gathers the model. Use FSDP2 (fsdp_version 2: DTensor state dicts, every rank pushes its shard)"
        )
    if any(hasattr(p, "ds_id") and getattr(p, "ds_status", None) is not None for p in model.parameters()):
        raise DeltaSyncError(
            "DeltaSyncCallback: DeepSpeed ZeRO-3 partitions the weights and state_dict() holds none of them; "
            "use ZeRO-1/2, DDP or FSDP2"
        )
