"""DeltaSyncCallback inside a real ``transformers.Trainer`` (tiny Qwen3, CPU): every step pushed and
bit-exact at a verifying fetcher, resume from a Trainer checkpoint, and DDP on gloo (two real
processes) where only the main process pushes."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import deltasync as ds
from deltasync.errors import ChainBroken
from deltasync.protocol import Manifest, manifest_key

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from qwen3 import QWEN3_KW, make_qwen3  # noqa: E402
from spy_store import SpyStore  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from deltasync.integrations.transformers import DeltaSyncCallback  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 300.0


def dataset(n: int = 64) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        x = torch.randint(0, QWEN3_KW["vocab_size"], (16,), generator=g)
        rows.append({"input_ids": x, "labels": x.clone()})
    return rows


def trainer(out: Path, callback: DeltaSyncCallback, max_steps: int, **kw: Any) -> Any:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(out),
        max_steps=max_steps,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        save_strategy=kw.pop("save_strategy", "no"),
        logging_strategy="no",
        seed=0,
        **kw,
    )
    return Trainer(model=make_qwen3(0), args=args, train_dataset=dataset(), callbacks=[callback])


def fetched(store: Any, like: dict[str, Any], step: int | None = None) -> dict[str, Any]:
    target = {k: torch.zeros_like(v) for k, v in like.items()}
    ds.DeltaFetcher(store, verify="full").sync(target, step=step)
    return target


def assert_bits_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(
            got[k].view(-1).view(torch.uint8), v.view(-1).view(torch.uint8)
        ), k


def model_state(tr: Any, dtype: Any = None) -> dict[str, Any]:
    return {k: v.detach().clone().to(dtype or v.dtype) for k, v in tr.model.state_dict().items()}


def kinds(store: Any) -> dict[int, tuple[str, int | None]]:
    reader = ds.RunReader(store)
    return {s: (m.kind, m.parent_step) for s in reader.steps() if (m := reader.manifest(s))}


def test_every_step_is_pushed_and_the_fetcher_ends_bit_exact(tmp_path: Path) -> None:
    store = ds.open_store(tmp_path / "store")
    cb = DeltaSyncCallback(store, anchor_every=100, anchor_bytes_fraction=0)
    tr = trainer(tmp_path / "out", cb, max_steps=4)
    tr.train()
    assert [(i.step, i.kind) for i in sorted(cb.results, key=lambda i: i.step)] == [
        (1, "anchor"), (2, "patch"), (3, "patch"), (4, "patch"),
    ]  # fmt: skip
    assert cb.errors == [] and cb.uploader is None  # flushed and closed at on_train_end
    assert_bits_equal(fetched(store, model_state(tr)), model_state(tr))


def test_every_n_with_cast_dtype_pushes_the_final_state_at_train_end(tmp_path: Path) -> None:
    store = ds.open_store(tmp_path / "store")
    cb = DeltaSyncCallback(store, every=3, cast_dtype=torch.bfloat16)
    tr = trainer(tmp_path / "out", cb, max_steps=4)
    tr.train()
    assert sorted(i.step for i in cb.results) == [3, 4]
    want = model_state(tr, torch.bfloat16)
    assert_bits_equal(fetched(store, want), want)
    with pytest.raises(ValueError, match="every"):
        DeltaSyncCallback(store, every=0)


def test_references_are_the_trainers_logprobs_of_the_stored_probes_at_each_nth_step(tmp_path: Path) -> None:
    from deltasync.protocol.audit import divergence
    from deltasync.run.probes import default_probes, list_references, read_probes, read_reference
    from deltasync.uploader._reference import probe_logprobs

    store = ds.open_store(tmp_path / "store")
    cb = DeltaSyncCallback(store, references=2, anchor_every=100)
    tr = trainer(tmp_path / "out", cb, max_steps=4)
    tr.train()
    assert cb.errors == [] and sorted(r.step for r in cb.references) == [2, 4]
    run_id = ds.RunReader(store).manifest(4).run_id
    probes = read_probes(store)
    assert probes is not None and probes == default_probes(QWEN3_KW["vocab_size"], run_id)  # derived from the run
    assert list_references(store) == [2, 4]
    for step in (2, 4):
        ref = read_reference(store, step)
        assert ref is not None and ref.probes_digest == probes.digest and ref.dtype == "float32"
        # the reference is what the model computes on the weights the store holds at that step
        model = make_qwen3(0)
        model.load_state_dict(fetched(store, model_state(tr), step=step))
        assert probe_logprobs(model, probes) == ref.logprobs
        assert model.training  # the forward left the mode as it was
    # the two steps' weights differ, and so do their references
    two, four = read_reference(store, 2), read_reference(store, 4)
    assert two is not None and four is not None and divergence(two.logprobs, four.logprobs).max_abs > 0
    with pytest.raises(ValueError, match="references"):
        DeltaSyncCallback(store, references=0)


def test_resume_from_a_trainer_checkpoint_continues_the_chain(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = ds.open_store(tmp_path / "store")
    out = tmp_path / "out"
    trainer(
        out, DeltaSyncCallback(store, anchor_every=100, anchor_bytes_fraction=0), 4, save_strategy="steps", save_steps=2
    ).train()
    assert ds.RunReader(store).latest_step() == 4

    # the "crashed" trainer comes back from checkpoint-4 == the store's head: proven, so step 5 is a patch
    cb = DeltaSyncCallback(store, anchor_every=100, anchor_bytes_fraction=0)
    tr = trainer(out, cb, 6, save_strategy="steps", save_steps=2)
    tr.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert kinds(store)[5] == ("patch", 4) and kinds(store)[6] == ("patch", 5)
    assert_bits_equal(fetched(store, model_state(tr)), model_state(tr))

    # back from checkpoint-2 while the store holds 6: steps 3..6 are not pushed again, 7 is an anchor
    cb = DeltaSyncCallback(store, anchor_every=100, anchor_bytes_fraction=0)
    tr = trainer(out, cb, 8)
    with caplog.at_level(logging.WARNING, "deltasync.integrations.transformers"):
        tr.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert "is ahead of this training run" in caplog.text
    assert sorted(i.step for i in cb.results) == [7, 8]
    assert kinds(store)[7] == ("anchor", 6) and kinds(store)[8] == ("patch", 7)
    assert_bits_equal(fetched(store, model_state(tr)), model_state(tr))
    assert Manifest.from_json(store.get(manifest_key(8))).writer.epoch == 3  # one writer epoch per train()


class Choreography(TrainerCallback):
    """Placed after the DeltaSyncCallback: holds the store's writes of step 1 while the next steps are
    pushed, then opens them (``when``: after the push of that step, or when that step's job is in the
    uploader's backlog), so the uploader is behind the trainer at exactly the same steps every run."""

    def __init__(self, cb: DeltaSyncCallback, store: SpyStore, open_at: int, *, on_release: bool) -> None:
        self.cb, self.store, self.open_at, self.on_release = cb, store, open_at, on_release
        self.released = threading.Event()
        store.gate = threading.Event()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.cb.uploader is not None

        def after_release(job: Any) -> None:  # the uploader's test seam, on its digest stage
            if job.step == self.open_at:
                self.released.set()
                if self.on_release:
                    assert self.store.gate is not None
                    self.store.gate.set()

        self.cb.uploader._pipeline.after_release = after_release

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.store.gate is not None
        if state.global_step == 1:  # step 1 is being written (and held): every later step finds it busy
            assert self.store.blocked.wait(TIMEOUT)
        if state.global_step == self.open_at and not self.on_release:
            assert self.released.wait(TIMEOUT)  # its job is in the backlog: only now may step 1 land
            self.store.gate.set()


def test_a_store_behind_folds_steps_and_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The default (on_backlog="coalesce"): training never waits; steps 3-5 go into the waiting step 2,
    committed as step 6. The uploader's log says so (the callback has no fold logging of its own: the
    user sees the first fold once), and an engine cannot be updated to exactly step 4."""
    store = SpyStore(ds.open_store(tmp_path / "store"))
    cb = DeltaSyncCallback(store, max_pending=1, anchor_every=100, anchor_bytes_fraction=0)
    tr = trainer(tmp_path / "out", cb, 6)
    tr.add_callback(Choreography(cb, store, 6, on_release=False))
    with caplog.at_level(logging.DEBUG, "deltasync"):
        tr.train()
    assert [(i.step, i.kind, i.committed_step) for i in sorted(cb.results, key=lambda i: i.step)] == [
        (1, "anchor", 1), (2, "skipped", 6), (3, "skipped", 6), (4, "skipped", 6), (5, "skipped", 6), (6, "patch", 6),
    ]  # fmt: skip
    assert [i.step for i in cb.folded] == [2, 3, 4, 5] and cb.errors == []
    said = [(r.name, r.levelname, r.getMessage()) for r in caplog.records if "was folded into" in r.getMessage()]
    assert [(name, level) for name, level, _ in said] == [("deltasync.uploader", "WARNING")] + [
        ("deltasync.uploader", "DEBUG")
    ] * 3
    assert said[0][2].startswith(
        "deltasync: step 2 was folded into step 6: the store fell behind (the commit of an earlier step was still "
        "running and max_pending=1 steps were already waiting for it; on_backlog='coalesce'), so step 2 is not "
        "committed as its own step and no engine can be updated to exactly it"
    )
    assert "DeltaSyncCallback: keep_every_step=True" in said[0][2]
    assert [m for _, _, m in said[1:]] == [
        f"deltasync: step {s} was folded into step 6 ({n} steps folded so far)" for n, s in ((2, 3), (3, 4), (4, 5))
    ]
    assert "deltasync: 2 steps committed to" in caplog.text and "4 folded into later steps, 0 errors" in caplog.text
    assert ds.RunReader(store).steps() == [1, 6]
    with pytest.raises(ChainBroken, match="step 4 is not committed"):
        fetched(store, model_state(tr), step=4)
    assert_bits_equal(fetched(store, model_state(tr), step=6), model_state(tr))


def test_keep_every_step_commits_each_step_while_the_store_is_behind(tmp_path: Path) -> None:
    """keep_every_step=True (on_backlog="block"): the same backlog makes a push wait instead; every step
    is committed on its own, and a fetcher reaches each one exactly."""
    store = SpyStore(ds.open_store(tmp_path / "store"))
    cb = DeltaSyncCallback(store, keep_every_step=True, max_pending=1, anchor_every=100, anchor_bytes_fraction=0)
    assert cb.uploader_options["on_backlog"] == "block"
    states: dict[int, dict[str, Any]] = {}

    class Record(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            states[state.global_step] = {k: v.detach().clone() for k, v in kwargs["model"].state_dict().items()}

    tr = trainer(tmp_path / "out", cb, 6)
    # step 1 is held until step 2 waits in the backlog: the push of step 3 may find no room and wait
    tr.add_callback(Choreography(cb, store, 2, on_release=True))
    tr.add_callback(Record())
    tr.train()
    assert [(i.step, i.kind) for i in sorted(cb.results, key=lambda i: i.step)] == [
        (1, "anchor"), (2, "patch"), (3, "patch"), (4, "patch"), (5, "patch"), (6, "patch"),
    ]  # fmt: skip
    assert cb.folded == [] and cb.errors == []
    for step in range(1, 7):
        assert_bits_equal(fetched(store, states[step], step=step), states[step])
    with pytest.raises(ValueError, match="keep_every_step=True commits every step"):
        DeltaSyncCallback(store, keep_every_step=True, on_backlog="coalesce")


def test_deltasync_does_not_import_transformers_unless_asked() -> None:
    code = "import sys, deltasync, deltasync.integrations; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------ DDP on gloo through the Trainer


def ddp_child(store_dir: str, out: str) -> None:
    """One rank of a 2-process DDP run (env set by the test): train, save the final weights, report."""
    from deltasync._util.checkpoint_io import save_checkpoint

    cb = DeltaSyncCallback(store_dir, anchor_every=100)
    tr = trainer(Path(out), cb, 3)
    tr.train()
    rank = int(os.environ["RANK"])
    save_checkpoint(model_state(tr), Path(out) / f"final-{rank}.safetensors")
    report = {"rank": rank, "ddp": type(tr.model_wrapped).__name__, "steps": sorted(i.step for i in cb.results)}
    print("REPORT " + json.dumps(report), flush=True)


def test_ddp_two_processes_push_once_per_step_from_rank_0(tmp_path: Path) -> None:
    from deltasync._util.checkpoint_io import load_checkpoint

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store_dir, out = tmp_path / "store", tmp_path / "out"
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
        }
        cmd = [sys.executable, __file__, str(store_dir), str(out)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    reports = {}
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=TIMEOUT)
            assert p.returncode == 0, stderr[-3000:]
            line = next(x for x in stdout.splitlines() if x.startswith("REPORT "))
            r = json.loads(line[len("REPORT ") :])
            reports[r["rank"]] = r
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(TIMEOUT)
    assert reports[0]["ddp"] == reports[1]["ddp"] == "DistributedDataParallel"
    assert (reports[0]["steps"], reports[1]["steps"]) == ([1, 2, 3], [])
    store = ds.open_store(store_dir)
    assert sorted(kinds(store)) == [1, 2, 3]
    assert [o.key for o in store.list("writers/")] == ["writers/000000000001.json"]  # one writer: rank 0
    final = load_checkpoint(out / "final-0.safetensors")
    assert_bits_equal(load_checkpoint(out / "final-1.safetensors"), final)  # DDP replicas agree
    assert_bits_equal(fetched(store, final), final)


if __name__ == "__main__":
    ddp_child(sys.argv[1], sys.argv[2])
