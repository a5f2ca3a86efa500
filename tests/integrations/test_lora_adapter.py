"""LoRA adapters through the store (docs/lora.md): a PEFT LoRA model on a tiny Qwen3 (real AdamW steps on
its LoRA parameters) pushed step after step; ``deltasync fetch/follow --out`` write a PEFT adapter dir
that ``PeftModel.from_pretrained`` loads, bit-exact to the trainer's adapter at each step;
``DeltaFetcher.sync`` into a PEFT model in place; every refusal (what vLLM cannot serve, a changed
config, adapters and full weights mixed); the bytes per step of the adapter path against the merged
weights TRL would otherwise send; the HF Trainer callback and TRL's ``DeltaSyncWeightTransfer`` (on a
trainer stand-in: AsyncGRPOTrainer's end-to-end run needs a real vLLM server) pushing the adapter."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

import deltasync as ds
from deltasync.cli.main import main
from deltasync.errors import DeltaSyncError
from deltasync.protocol.adapter import ADAPTER_CONFIG_KEY, ADAPTER_WEIGHTS_NAME, AdapterMismatch, UnsupportedAdapter
from deltasync.storage import Store
from deltasync.storage.wrapper import WrapperStore

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from qwen3 import QWEN3_KW, make_qwen3  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

TARGETS = ["q_proj", "v_proj"]
#: peft 0.21.2 reads transformers 5's deprecated ``is_gradient_checkpointing`` when it wraps a model
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def lora_model(seed: int = 0, **lora: Any) -> Any:
    """The tiny Qwen3 (base seed 0) with a LoRA adapter (rank 4 on q/v unless told), its A/B seeded by ``seed``."""
    base = make_qwen3(0)
    torch.manual_seed(seed)
    kw: dict[str, Any] = {"r": 4, "lora_alpha": 8, "target_modules": TARGETS, **lora}
    return peft.get_peft_model(base, peft.LoraConfig(**kw))


def train(model: Any, opt: Any, steps: int = 1) -> None:
    """Real AdamW steps on the LoRA parameters (a language-model loss on random tokens)."""
    g = torch.Generator().manual_seed(int(opt.state_dict()["state"].get(0, {}).get("step", 0)))
    for _ in range(steps):
        x = torch.randint(0, QWEN3_KW["vocab_size"], (2, 12), generator=g)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()


def optimizer(model: Any) -> Any:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def adapter_of(model: Any) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(model).items()}


def assert_bits_equal(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert sorted(got) == sorted(want), what
    for k, v in want.items():
        g = got[k]
        assert g.dtype == v.dtype and g.shape == v.shape, (what, k)
        assert torch.equal(g.contiguous().view(-1).view(torch.uint8), v.contiguous().view(-1).view(torch.uint8)), (
            what,
            k,
        )


def assert_adapter_dir(out: Path, want: dict[str, Any], step: int) -> None:
    """``out`` is a PEFT adapter dir (config + safetensors; only the hidden marker beside) holding ``want``."""
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        ADAPTER_CONFIG_KEY,
        ADAPTER_WEIGHTS_NAME,
    ]
    assert_bits_equal(load_file(str(out / ADAPTER_WEIGHTS_NAME)), want, f"{out} step {step}")
    loaded = peft.PeftModel.from_pretrained(make_qwen3(0), str(out))
    cfg = loaded.peft_config["default"]
    assert (cfg.r, cfg.lora_alpha, sorted(cfg.target_modules)) == (4, 8, TARGETS)
    assert_bits_equal(adapter_of(loaded), want, f"PeftModel.from_pretrained({out}) step {step}")


def test_adapter_steps_reach_fetch_follow_dirs_and_a_peft_model_bit_exact(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    store = ds.open_store(url)
    model = lora_model(1)
    opt = optimizer(model)
    reader_model = lora_model(2)  # another init of the same config: sync overwrites every LoRA tensor
    fetcher = ds.DeltaFetcher(store, verify="full")
    fetched, followed = tmp_path / "fetched", tmp_path / "followed"
    with ds.DeltaUploader(store, anchor_every=100, anchor_bytes_fraction=0) as up:
        for step in range(5):
            if step:
                train(model, opt)
            want = adapter_of(model)
            info = up.push(model, step).result(timeout=120)
            assert info.kind == ("anchor" if step == 0 else "patch")
            assert main(["fetch", "--store", url, "--out", str(fetched), "--step", str(step)]) == 0
            assert_adapter_dir(fetched, want, step)
            assert main(["follow", "--store", url, "--out", str(followed), "--until", str(step)]) == 0
            assert_adapter_dir(followed, want, step)
            assert fetcher.sync(reader_model) == step
            assert_bits_equal(adapter_of(reader_model), want, f"DeltaFetcher.sync step {step}")
    # the run is an adapter run: its inventory is the adapter's tensors only, its config stored once
    inventory = ds.RunReader(store).manifest(4).inventory
    assert sorted(t.name for t in inventory) == sorted(want)
    stored = json.loads(store.get(ADAPTER_CONFIG_KEY))
    assert (stored["r"], stored["lora_alpha"], stored["target_modules"], stored["inference_mode"]) == (
        4,
        8,
        TARGETS,
        True,
    )
    assert json.loads((fetched / ".deltasync.json").read_text())["kind"] == "adapter"
    # DeltaFetcher.follow keeps a PEFT model current (the store polled: no signal server)
    follower_model = lora_model(3)
    assert ds.DeltaFetcher(store).follow(follower_model, until_step=4, poll_interval=0.05) == 4
    assert_bits_equal(adapter_of(follower_model), want, "DeltaFetcher.follow step 4")


def test_adapter_bytes_per_step_against_the_merged_weights_of_the_same_training(tmp_path: Path) -> None:
    """The same AdamW steps pushed as the adapter (fp32, as trained) and as the merged bf16 weights TRL
    hands an injected weight transfer (``W + scale * B @ A`` on the bf16 grid, every adapted element)."""
    model = lora_model(1)
    opt = optimizer(model)
    a_store, m_store = ds.open_store(tmp_path / "adapter"), ds.open_store(tmp_path / "merged")
    a_bytes: list[int] = []
    m_bytes: list[int] = []
    with (
        ds.DeltaUploader(a_store, anchor_every=100, anchor_bytes_fraction=0) as a_up,
        ds.DeltaUploader(m_store, anchor_every=100, anchor_bytes_fraction=0, cast_dtype=torch.bfloat16) as m_up,
    ):
        for step in range(6):
            if step:
                train(model, opt)
            merged = copy.deepcopy(model).merge_and_unload().state_dict()
            a_info = a_up.push(model, step).result(timeout=120)
            m_info = m_up.push(merged, step).result(timeout=120)
            if step:  # patches (step 0 is each run's anchor)
                a_bytes.append(a_info.nbytes)
                m_bytes.append(m_info.nbytes)
    a_mean, m_mean = sum(a_bytes) / len(a_bytes), sum(m_bytes) / len(m_bytes)
    figures = (
        f"bytes per step (5 patches, tiny Qwen3, rank 4 on q/v): adapter {a_mean:.0f} B, "
        f"merged bf16 {m_mean:.0f} B ({m_mean / a_mean:.1f}x); per step adapter {a_bytes}, merged {m_bytes}"
    )
    print(figures)
    assert a_mean < m_mean, figures


class _CountingStore(WrapperStore[Store]):
    """Counts the bounded reads of each key (how ``adapter_config.json`` is read)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.bounded: list[str] = []

    def get_many_bounded(self, limits: Mapping[str, int]) -> dict[str, bytes]:
        self.bounded.extend(limits)
        return self.inner.get_many_bounded(limits)


def test_a_full_weights_run_materializes_as_before_and_its_kind_is_read_once(tmp_path: Path) -> None:
    """A full-weights run's dir is a checkpoint (shards + index, no adapter file); the fetcher asks the
    store for ``adapter_config.json`` once, not at every materialize of ``follow --out``."""
    inner = ds.open_store(tmp_path / "store")
    model = make_qwen3(0)
    with ds.DeltaUploader(inner) as up:
        up.push(model.state_dict(), 0).result(timeout=60)
        with torch.no_grad():
            model.lm_head.weight[0, :4] += 1
        up.push(model.state_dict(), 1).result(timeout=60)
    store = _CountingStore(inner)
    fetcher = ds.DeltaFetcher(store)
    out = tmp_path / "ckpt"
    for step in (0, 1):
        fetcher.materialize(out, step)
        names = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
        assert names == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"], names
    assert store.bounded.count(ADAPTER_CONFIG_KEY) == 1
    assert "kind" not in json.loads((out / ".deltasync.json").read_text())


def test_a_restarted_trainer_resumes_an_adapter_run_with_patches(tmp_path: Path) -> None:
    store = ds.open_store(tmp_path / "store")
    model = lora_model(1)
    opt = optimizer(model)
    with ds.DeltaUploader(store, anchor_every=100, anchor_bytes_fraction=0) as up:
        up.push(model, 0).result(timeout=60)
        train(model, opt)
        up.push(model, 1).result(timeout=60)
    with ds.DeltaUploader(store, anchor_every=100, anchor_bytes_fraction=0) as up:
        assert up.resume(model, 1, strict=True)  # proven by the adapter's digests
        train(model, opt)
        assert up.push(model, 2).result(timeout=60).kind == "patch"
    target = lora_model(2)
    assert ds.DeltaFetcher(store, verify="full").sync(target) == 2
    assert_bits_equal(adapter_of(target), adapter_of(model), "resumed step 2")


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("lora", "field"),
    [
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"use_dora": True}, "use_dora"),
        ({"bias": "lora_only"}, "bias"),
        ({"target_modules": ["q_proj", "lm_head"]}, "lm_head"),
    ],
    ids=["modules_to_save", "dora", "bias", "lm_head"],
)
def test_what_vllm_cannot_serve_is_refused_before_anything_is_written(lora: dict[str, Any], field: str) -> None:
    store = ds.MemoryStore("r")
    with ds.DeltaUploader(store) as up, pytest.raises(UnsupportedAdapter, match=field) as err:
        up.push(lora_model(1, **lora), 0)
    assert "train with" in str(err.value) or "leave" in str(err.value)  # the way out
    assert [o.key for o in store.list("")] == []


def test_two_active_adapters_are_refused() -> None:
    model = lora_model(1)
    model.add_adapter("second", peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    model.base_model.set_adapter(["default", "second"])
    store = ds.MemoryStore("r")
    with ds.DeltaUploader(store) as up, pytest.raises(UnsupportedAdapter, match="2 active adapters.*set_adapter"):
        up.push(model, 0)
    assert [o.key for o in store.list("")] == []


def test_a_changed_config_on_a_later_push_names_the_field_and_a_new_run(tmp_path: Path) -> None:
    store = ds.open_store(tmp_path / "store")
    with ds.DeltaUploader(store) as up:
        up.push(lora_model(1), 0).result(timeout=60)
        with pytest.raises(AdapterMismatch, match=r"r: 4 -> 8.*new run prefix"):
            up.push(lora_model(1, r=8), 1)
        with pytest.raises(AdapterMismatch, match=r"lora_alpha: 8 -> 16"):
            up.push(lora_model(1, lora_alpha=16), 1)
        with pytest.raises(AdapterMismatch, match="full state cannot join"):
            up.push(lora_model(1).state_dict(), 1)
        up.push(lora_model(3), 1).result(timeout=60)  # the same config goes on
    # a restarted trainer with another target set: the stored config is written once
    with ds.DeltaUploader(store) as up, pytest.raises(AdapterMismatch, match=r"target_modules: \['q_proj', 'v_proj'\]"):
        up.push(lora_model(1, target_modules=["q_proj", "k_proj", "v_proj"]), 2)
    assert ds.RunReader(store).steps() == [0, 1]


def test_adapters_and_full_weights_do_not_mix_in_one_run() -> None:
    store = ds.MemoryStore("full")
    with ds.DeltaUploader(store) as up:
        up.push(make_qwen3(0).state_dict(), 0).result(timeout=60)
    with ds.DeltaUploader(store) as up, pytest.raises(AdapterMismatch, match="full weights.*new run prefix"):
        up.push(lora_model(1), 1)
    with pytest.raises(AdapterMismatch, match="not an adapter run"):
        ds.DeltaFetcher(store).sync(lora_model(1))


def test_sync_refuses_a_peft_model_whose_config_is_not_the_runs() -> None:
    store = ds.MemoryStore("r")
    with ds.DeltaUploader(store) as up:
        up.push(lora_model(1), 0).result(timeout=60)
    target = lora_model(2, r=8)
    before = adapter_of(target)
    with pytest.raises(AdapterMismatch, match=r"r: 4 -> 8"):
        ds.DeltaFetcher(store).sync(target)
    assert_bits_equal(adapter_of(target), before, "untouched")


# ------------------------------------------------------------------ trainers


def test_hf_trainer_callback_pushes_the_adapter_of_a_peft_model(tmp_path: Path) -> None:
    from transformers import Trainer, TrainingArguments

    from deltasync.integrations.transformers import DeltaSyncCallback

    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(16):
        x = torch.randint(0, QWEN3_KW["vocab_size"], (12,), generator=g)
        rows.append({"input_ids": x, "labels": x.clone()})
    store = ds.open_store(tmp_path / "store")
    model = lora_model(1)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        logging_strategy="no",
        seed=0,
    )
    cb = DeltaSyncCallback(store, anchor_every=100, anchor_bytes_fraction=0)
    Trainer(model=model, args=args, train_dataset=rows, callbacks=[cb]).train()
    assert not cb.errors
    assert ds.RunReader(store).steps() == [1, 2, 3]
    target = lora_model(2)
    assert ds.DeltaFetcher(store, verify="full").sync(target) == 3
    assert_bits_equal(adapter_of(target), adapter_of(model), "callback step 3")
    assert json.loads(store.get(ADAPTER_CONFIG_KEY))["r"] == 4


class _Trainer:
    """A stand-in for TRL's AsyncGRPOTrainer as DeltaSyncWeightTransfer.attach reads it (``model``, ``_metrics``)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._metrics: dict[str, dict[str, list[Any]]] = {"train": {}}


def test_trl_weight_transfer_pushes_the_adapter_not_the_merged_weights(tmp_path: Path) -> None:
    """TRL merges the adapter and hands send_weights the merged trainable weights; with a PEFT model the
    transfer drains them and pushes the adapter (AsyncGRPOTrainer's own run needs a vLLM server: not here)."""
    from deltasync.integrations.trl import DeltaSyncWeightTransfer

    store = ds.open_store(tmp_path / "store")
    model = lora_model(1)
    opt = optimizer(model)
    transfer = DeltaSyncWeightTransfer(store, anchor_every=100, anchor_bytes_fraction=0)
    transfer.attach(_Trainer(model))
    transfer.init_weight_transfer()
    drained: list[str] = []

    def merged_weights() -> Iterator[tuple[str, Any]]:
        model.merge_adapter()  # as TRL's _sync_weight_merged does around send_weights
        try:
            for name, p in model.base_model.model.named_parameters():
                if "lora_" not in name:
                    drained.append(name)
                    yield name, p.detach()
        finally:
            model.unmerge_adapter()

    target = lora_model(2)
    fetcher = ds.DeltaFetcher(store, verify="full")
    for sync in range(3):
        if sync:
            train(model, opt)
        want = adapter_of(model)
        drained.clear()
        transfer.pause()
        transfer.send_weights(merged_weights())
        transfer.resume()
        assert drained, "the merged weights were drained (TRL's other ranks drain the same generator)"
        assert fetcher.sync(target) == sync
        assert_bits_equal(adapter_of(target), want, f"TRL sync {sync}")
    transfer.destroy()
    assert [r.step for r in transfer.history] == [0, 1, 2]
    assert sorted(t.name for t in ds.RunReader(store).manifest(2).inventory) == sorted(want)


def test_trl_weight_transfer_with_servers_refuses_an_adapter_run_it_cannot_serve_yet(tmp_path: Path) -> None:
    from deltasync.integrations.trl import DeltaSyncWeightTransfer

    store = ds.open_store(tmp_path / "store")
    transfer = DeltaSyncWeightTransfer(store, servers=["http://127.0.0.1:9"])
    transfer.attach(_Trainer(lora_model(1)))
    with pytest.raises(DeltaSyncError, match=r"servers=\(\)"):
        transfer.init_weight_transfer()  # at train begin, before any server is contacted or anything written
    assert transfer.driver is None and transfer.uploader is None
    # a model set after init (no attach at train begin): refused at the sync, the merged weights drained first
    late = DeltaSyncWeightTransfer(store, servers=["http://127.0.0.1:9"])
    late.uploader, late.next_step = ds.DeltaUploader(store), 0  # as init_weight_transfer leaves them
    late.model = lora_model(1)
    sent = iter([("model.norm.weight", torch.ones(4))])
    with pytest.raises(DeltaSyncError, match=r"servers=\(\)"):
        late.send_weights(sent)
    assert next(sent, None) is None  # drained, as TRL's other ranks drain theirs
    late.destroy()
    assert [o.key for o in store.list("")] == []
