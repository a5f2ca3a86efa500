"""Shared fixtures and helpers of the uploader / fetcher / end-to-end tests.

Helpers are plain functions and classes; tests import them with ``from conftest import ...``.
torch and transformers are imported only inside the helpers that need them, so test
modules that do not use them (protocol, storage) do not pay for importing them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pytest

from deltasync.errors import StorageError
from deltasync.storage import ObjectInfo, Store
from deltasync.storage.base import Data, PutMode

GATE_TIMEOUT = 60.0  # a gated write that waits this long means a test forgot to open its gate


# ----------------------------------------------------------------- tensors


def load_bench(name: str) -> Iterator[Any]:
    """Import ``benchmarks/<name>.py`` as module ``name`` for a test module's life (a fixture body)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up here
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(name, None)


def anchor_manifest(inventory: Sequence[Any], arrays: Mapping[str, Any], step: int = 0) -> tuple[Any, dict[str, bytes]]:
    """A valid anchor ``step`` of ``arrays`` (flat bit arrays by name): its manifest (parsed back from
    its JSON, no tensor digests) and its files, as the protocol builds them."""
    from deltasync.protocol import FileInfo, Manifest, Stats, inventory_digest, xxh3_128
    from deltasync.protocol.checkpoint import build_checkpoint

    inv = tuple(inventory)
    files, entries = build_checkpoint(inv, arrays, 1 << 20)
    infos = tuple(FileInfo(n, len(d), xxh3_128(d)) for n, d in sorted(files.items()))
    numel = sum(t.numel for t in inv)
    m = Manifest(
        run_id="r",
        step=step,
        kind="anchor",
        parent_step=None,
        parent_digest=None,
        anchor_step=step,
        inventory=inv,
        inventory_digest=inventory_digest(inv),
        files=infos,
        entries=tuple(entries),
        tensor_digests={},
        stats=Stats(numel, numel, sum(f.size for f in infos)),
    )
    return Manifest.from_json(m.to_json()), files


def bits_of(t: Any) -> Any:
    """Flat integer view of a tensor's raw bits (a contiguous copy; works for 0-d and empty tensors)."""
    import torch

    t = t.detach().contiguous().reshape(-1)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(width)


def bits_equal(a: Any, b: Any) -> bool:
    """True when two tensors have the same dtype and shape and bit-identical contents (NaNs, -0.0 included)."""
    import torch

    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    return bool(torch.equal(bits_of(a), bits_of(b)))


def snapshot(state: Any) -> dict[str, Any]:
    """Independent copies of every tensor of an nn.Module or a dict of tensors."""
    import torch

    tensors = state.state_dict() if isinstance(state, torch.nn.Module) else state
    return {k: v.detach().clone() for k, v in tensors.items()}


def assert_state_equal(got: Any, want: Mapping[str, Any], what: str = "") -> None:
    """Same names, and every tensor bit-identical (dtype and shape included)."""
    import torch

    got_t = got.state_dict() if isinstance(got, torch.nn.Module) else got
    assert sorted(got_t) == sorted(want), f"{what}: names differ"
    bad = [k for k in sorted(want) if not bits_equal(got_t[k], want[k])]
    assert not bad, f"{what}: tensors not bit-identical: {bad[:5]}"


def bf16_view(model: Any) -> dict[str, Any]:
    """What a trainer pushes: the bf16 view of fp32 master weights."""
    import torch

    return {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}


# ------------------------------------------------------------------- model

QWEN3_KW: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def qwen3_config(tie: bool = False) -> Any:
    """Config of the tiny Qwen3 model."""
    from transformers import Qwen3Config

    return Qwen3Config(**QWEN3_KW, tie_word_embeddings=tie)


def make_qwen3(seed: int = 0, *, tie: bool = False, dtype: Any = None) -> Any:
    """A tiny, randomly initialised Qwen3ForCausalLM (fp32 unless ``dtype``)."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(qwen3_config(tie))
    if dtype is not None:
        model = model.to(dtype)
    return model


def train_steps(model: Any, steps: int, lr: float, seed: int = 0) -> Iterator[int]:
    """Run ``steps`` AdamW steps on random token batches, yielding after each optimizer step."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for step in range(steps):
        x = torch.randint(0, QWEN3_KW["vocab_size"], (2, 16), generator=gen)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield step


# ------------------------------------------------------------------ stores


class SpyStore(Store):
    """Wraps a store: records every key read and written, and can hold or fail writes.

    ``gate``: when set to an Event, ``put_many`` waits for it (so a test controls exactly
    when the uploader's writes may proceed). ``fail``: a predicate over the keys of a
    ``put_many`` call; when it returns True the call raises StorageError instead.
    ``delay``: seconds every ``put_many`` sleeps first. Writer claims (``writers/``, written
    by an uploader's first push) pass straight through, unrecorded.
    """

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.url = inner.url
        self.supports_conditional_put = inner.supports_conditional_put  # type: ignore[misc]
        self.gate: threading.Event | None = None
        self.fail: Callable[[Sequence[str]], bool] | None = None
        self.delay = 0.0
        self.gets: list[str] = []
        self.puts: list[str] = []
        self.blocked = threading.Event()  # set while a put_many waits on the gate
        self._lock = threading.Lock()

    def reset(self) -> None:
        """Forget the recorded keys."""
        with self._lock:
            self.gets.clear()
            self.puts.clear()

    def put_many(self, items: Mapping[str, Data], *, mode: PutMode = "overwrite") -> None:
        # docstring inherited
        keys = list(items)
        if all(k.startswith("writers/") for k in keys):
            self.inner.put_many(items, mode=mode)
            return
        if self.delay:
            time.sleep(self.delay)
        gate = self.gate
        if gate is not None and not gate.is_set():
            self.blocked.set()
            if not gate.wait(GATE_TIMEOUT):
                raise StorageError("SpyStore: gate never opened (test bug)")
        if self.fail is not None and self.fail(keys):
            raise StorageError(f"SpyStore: injected write failure for {keys[0]}")
        self.inner.put_many(items, mode=mode)
        with self._lock:
            self.puts.extend(keys)

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        # docstring inherited
        with self._lock:
            self.gets.extend(keys)
        return self.inner.get_many(keys)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        # docstring inherited
        with self._lock:
            self.gets.append(key)
        return self.inner.get_range(key, start, end)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        # docstring inherited
        return self.inner.list(prefix)

    def delete_many(self, keys: Sequence[str]) -> None:
        # docstring inherited
        self.inner.delete_many(keys)

    def data_gets(self) -> list[str]:
        """Keys of data files read (manifests and HEAD left out)."""
        with self._lock:
            return [k for k in self.gets if k.startswith("steps/") and not k.endswith("/manifest.json")]


@pytest.fixture
def spy_store(tmp_path: Any) -> SpyStore:
    """A SpyStore over a LocalStore in ``tmp_path / 'store'``."""
    from deltasync import LocalStore

    return SpyStore(LocalStore(tmp_path / "store", fsync=False))


def step_of_key(key: str) -> int:
    """The step number in ``steps/000000000012/...``."""
    return int(key.split("/")[1])


# the session-wide S3 server (SeaweedFS on loopback) of the s3:// tests
from s3server import s3_server  # noqa: E402,F401
