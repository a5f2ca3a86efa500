"""The demo's pieces in-process: toy task, hub state, manifest rows, trainer + follower, the web app."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

import deltasync as ds
from deltasync.errors import DemoError, StorageError

pytest.importorskip("fastapi", reason="the demo extra is part of the test extra")

from spaces_demo import live  # noqa: E402
from spaces_demo.board import LiveBoard  # noqa: E402
from spaces_demo.live import (  # noqa: E402
    DEMO_KEY,
    DEMO_MARKER,
    DemoOptions,
    DemoRun,
    Episode,
    StepSignal,
    bit_snapshot,
    layer_change,
    manifest_row,
    prepare_demo_store,
)
from spaces_demo.toy import PROMPT, QA, TARGET, CharTokenizer, build_model, greedy, layer_groups, training_batch  # noqa: E402

RUN_TIMEOUT = 120.0


# ------------------------------------------------------------------- toy


def test_tokenizer_round_trips_the_task_and_stops_at_eos() -> None:
    tok = CharTokenizer()
    for q, a in QA:
        text = f"Q: {q}\nA: {a}"
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode([*tok.encode("ab"), tok.EOS, *tok.encode("cd")]) == "ab"
    assert tok.decode(tok.encode("é")) == "?"
    assert PROMPT.startswith("Q: ") and " " + QA[0][1] == TARGET


def test_training_batch_masks_the_prompts() -> None:
    tok = CharTokenizer()
    ids, mask, labels = training_batch(tok)
    assert ids.shape == mask.shape == labels.shape and ids.shape[0] == len(QA)
    first = tok.decode([int(i) for i in ids[0] if int(i) != tok.PAD])
    assert first == PROMPT + TARGET
    supervised = [int(t) for t in labels[0] if int(t) != -100]
    assert tok.decode(supervised) == TARGET  # the answer, then EOS; the prompt carries no loss
    assert supervised[-1] == tok.EOS


def test_layer_groups_order_and_cover_every_tensor() -> None:
    _, model = build_model("tiny")
    names = list(model.state_dict())
    groups = layer_groups(names)
    assert [g for g, _ in groups] == ["embed", "layer 0", "layer 1", "norm", "lm_head"]
    assert sorted(n for _, ns in groups for n in ns) == sorted(names)


def test_default_model_is_a_small_qwen3() -> None:
    toy, model = build_model("small")
    assert type(model).__name__ == "Qwen3ForCausalLM" and toy.config.model_type == "qwen3"
    assert sum(p.numel() for p in model.parameters()) == 425_376  # the README's "0.4M parameters"
    assert toy.config.vocab_size == CharTokenizer().vocab_size == 98


def test_unknown_model_name_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown demo model 'huge'"):
        build_model("huge")


def test_greedy_is_deterministic_and_bounded() -> None:
    import torch

    toy, model = build_model("tiny", dtype=torch.bfloat16)
    a = greedy(model, toy.tokenizer, max_new=8)
    assert a == greedy(model, toy.tokenizer, max_new=8)
    assert len(a) <= 8 and "\n" not in a


# ------------------------------------------------------------------- hub


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_hub_staleness_is_committed_minus_applied() -> None:
    clock = FakeClock()
    hub = LiveBoard({"mode": "self-contained"}, clock=clock)
    hub.trainer_step(0, loss=None)
    # produced but not committed yet: the uploader's pipeline, not staleness
    assert hub.snapshot()["staleness"] == {"committed": None, "applied": None, "steps": None, "seconds": 0.0}
    hub.set_head(0)
    assert hub.snapshot()["staleness"] == {"committed": 0, "applied": None, "steps": 1, "seconds": 0.0}
    clock.t += 2
    hub.trainer_step(1, loss=1.0)
    hub.set_head(1)
    st = hub.snapshot()["staleness"]
    assert st["steps"] == 2 and st["seconds"] == pytest.approx(2.0)
    hub.applied(0, text="a", sync_ms=1.0)
    clock.t += 0.5
    st = hub.snapshot()["staleness"]
    assert (st["steps"], st["seconds"]) == (1, pytest.approx(0.5))  # step 1 waits since t=1002
    assert hub.snapshot()["applied"]["latency"] == pytest.approx(2.0)
    hub.trainer_step(2, loss=0.5)  # the trainer is ahead of the store: still 1 committed step behind
    snap = hub.snapshot()
    assert snap["staleness"]["steps"] == snap["head"] - snap["applied"]["step"] == 1
    hub.applied(1, text="a", sync_ms=1.0)
    st = hub.snapshot()["staleness"]
    assert (st["steps"], st["seconds"]) == (0, 0.0)
    snap = hub.snapshot()
    assert [g["step"] for g in snap["generations"]] == [0]  # same text: one history entry
    assert snap["applied_steps"] == [0, 1]


def test_staleness_chart_samples_each_commit_and_each_apply() -> None:
    clock = FakeClock()
    hub = LiveBoard({"mode": "self-contained"}, clock=clock)
    hub.set_head(0)
    hub.applied(0, text="a", sync_ms=1.0)
    for step in (1, 2, 3):  # the trainer commits three steps while the copy holds step 0
        clock.t += 1
        hub.set_head(step)
    hub.set_head(3)  # the same head again: not a new sample
    clock.t += 1
    hub.applied(3, text="b", sync_ms=1.0)
    lag = hub.snapshot()["lag"]
    assert [p["steps"] for p in lag] == [1, 0, 1, 2, 3, 0]
    assert [p["seconds"] for p in lag] == [0.0, 0.0, 0.0, 1.0, 2.0, 0.0]
    assert hub.snapshot()["staleness"]["steps"] == lag[-1]["steps"]


def test_staleness_chart_rises_while_the_follower_lags(monkeypatch: pytest.MonkeyPatch) -> None:
    """The follower is held before its first sync until the trainer has committed every step
    (an event, no timing): the chart's series shows the lag the staleness tile shows."""
    store = ds.MemoryStore()
    run = DemoRun(store, DemoOptions(store_url="memory://lag", model="tiny", steps=5, step_interval=0.0))
    sync = ds.DeltaFetcher.sync

    def held_sync(self: ds.DeltaFetcher, *args: Any, **kwargs: Any) -> Any:
        assert run.current.trainer_done.wait(RUN_TIMEOUT), "the trainer did not finish"
        return sync(self, *args, **kwargs)

    monkeypatch.setattr(ds.DeltaFetcher, "sync", held_sync)
    _run_until_done(run)
    snap = run.board.snapshot()
    assert run.bit_exact is True
    # (samples before the first commit have no head: None, which the page does not draw)
    steps = [p["steps"] for p in snap["lag"] if p["steps"] is not None]
    # the commits were sampled while the copy held nothing: up to all of steps 0..5 behind
    assert max(steps) == 6 and steps[0] == 1, steps
    assert steps[-1] == 0 == snap["staleness"]["steps"]  # caught up


def test_hub_broadcasts_snapshot_then_events_in_order() -> None:
    async def main() -> list[dict[str, Any]]:
        hub = LiveBoard({"mode": "follower"})
        sub = hub.subscribe(asyncio.get_running_loop())
        t = threading.Thread(target=lambda: (hub.committed({"step": 3, "kind": "anchor"}), hub.set_status("x")))
        t.start()
        t.join()
        got = [await asyncio.wait_for(sub.queue.get(), 5) for _ in range(3)]
        hub.close()
        assert await asyncio.wait_for(sub.queue.get(), 5) is None
        return [g for g in got if g is not None]

    events = asyncio.run(main())
    assert [e["type"] for e in events] == ["snapshot", "commit", "status"]
    assert events[1]["data"]["step"] == 3 and events[1]["seq"] < events[2]["seq"]


def test_step_signal_wakes_on_notify_and_times_out_otherwise() -> None:
    sig = StepSignal()
    assert sig.wait(None, 0.01) is False
    threading.Timer(0.05, sig.notify, args=(4,)).start()
    assert sig.wait(3, 10.0) is True
    assert sig.wait(4, 0.01) is False  # nothing newer than 4
    sig.close()
    assert sig.wait(99, 10.0) is True


# ------------------------------------------------------------ manifests


def test_manifest_row_and_layer_change_match_a_bitwise_diff() -> None:
    import torch

    toy, model = build_model("tiny")
    store = ds.MemoryStore()
    ids, mask, labels = training_batch(toy.tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _, infer = build_model("tiny", seed=5, dtype=torch.bfloat16)
    fetcher = ds.DeltaFetcher(store)
    with ds.DeltaUploader(store, cast_dtype=torch.bfloat16) as up:
        up.push(model, 0).result()
        before = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        opt.step()
        info = up.push(model, 1).result()
    after = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    assert info.kind == "patch"
    from deltasync import RunReader

    reader = RunReader(store)
    anchor = manifest_row(reader.committed(0).manifest)
    assert anchor["kind"] == "anchor" and anchor["changed"] == anchor["total"]
    row = manifest_row(reader.committed(1).manifest)
    assert row["kind"] == "patch" and row["parent"] == 0 and row["anchor"] == 0
    assert (row["changed"], row["nbytes"]) == (info.changed, info.nbytes)
    assert row["full_bytes"] == sum(v.numel() * 2 for v in after.values())

    groups = layer_groups(list(after))
    fetcher.sync(infer, step=0)
    snap = bit_snapshot(infer)
    fetcher.sync(infer, step=1)
    fractions, changed = layer_change(snap, infer, groups)
    assert changed == info.changed  # the copy saw exactly the manifest's changed elements
    for (_, names), frac in zip(groups, fractions, strict=True):
        n = sum(int((before[k].view(torch.int16) != after[k].view(torch.int16)).sum()) for k in names)
        assert frac == pytest.approx(n / sum(before[k].numel() for k in names))
    assert 0 < changed < row["total"]


# ------------------------------------------------------- trainer + follower


def _run_until_done(run: DemoRun) -> None:
    run.start()
    try:
        assert run.finished.wait(RUN_TIMEOUT), f"demo did not finish: {run.board.snapshot()['status']}"
    finally:
        run.stop()


def test_self_contained_run_ends_bit_exact_and_reports_every_commit() -> None:
    store = ds.MemoryStore()
    run = DemoRun(store, DemoOptions(store_url="memory://t", model="tiny", steps=12, step_interval=0.0, anchor_every=5))
    _run_until_done(run)
    snap = run.board.snapshot()
    assert run.bit_exact is True and snap["bit_exact"] is True and snap["status"] == "done"
    assert snap["error"] is None
    steps = ds.DeltaFetcher(store).steps()
    assert steps[0] == 0 and steps[-1] == 12  # (the uploader may coalesce steps while the store is busy)
    assert [c["step"] for c in snap["commits"]] == steps  # the follower read every manifest
    assert snap["commits"][0]["kind"] == "anchor" and snap["commits"][0]["layers"] is None
    # every later step was applied one by one: its heatmap column is measured on the copy, and
    # for a patch the copy's changed elements are exactly the manifest's count
    for c in snap["commits"][1:]:
        assert c["held"] and len(c["layers"]) == len(snap["groups"])
        assert all(0.0 <= f <= 1.0 for f in c["layers"])
        if c["kind"] == "patch":
            assert c["observed_changed"] == c["changed"]
    assert snap["applied_steps"] == steps
    assert snap["applied"]["step"] == 12 and snap["applied"]["verified"] is True
    assert isinstance(snap["applied"]["text"], str) and snap["generations"]
    assert snap["trainer"]["done"] is True and snap["trainer"]["step"] == 12
    assert snap["staleness"]["steps"] == 0
    # no signal server here: every step was found by a store poll (woken by the uploader's callbacks)
    assert snap["signal_server"] is None and snap["paths"] == {"signal": 0, "store": len(steps)}
    assert json.loads(store.get(DEMO_KEY))["model"] == "tiny"
    assert snap["model"]["params"] == sum(c["total"] for c in snap["commits"][:1])


def _follow_until(follower: DemoRun, step: int) -> None:
    """Run ``follower`` until its inference copy holds ``step`` (bounded), then stop it."""
    follower.start()
    try:
        done = threading.Event()

        def check() -> None:
            while not done.wait(0.05):
                if follower.board.applied_step == step:
                    done.set()

        t = threading.Thread(target=check)
        t.start()
        t.join(RUN_TIMEOUT)
        assert done.is_set(), follower.board.snapshot()
    finally:
        follower.stop()


def test_follower_mode_applies_what_a_trainer_elsewhere_committed(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    trainer = DemoRun(ds.open_store(url), DemoOptions(store_url=url, model="tiny", steps=6, step_interval=0.0))
    _run_until_done(trainer)
    # the follower has no trainer: it learns the model from demo.json, not from --model
    follower = DemoRun(ds.open_store(url), DemoOptions(store_url=url, train=False, model="small", poll_interval=0.05))
    _follow_until(follower, 6)
    snap = follower.board.snapshot()
    assert snap["mode"] == "follower" and snap["trainer"] is None and snap["error"] is None
    assert snap["model"]["name"] == "tiny"
    assert [c["step"] for c in snap["commits"]] == ds.DeltaFetcher(ds.open_store(url)).steps()
    assert snap["applied"]["text"] == trainer.board.snapshot()["applied"]["text"]


def test_a_follower_far_behind_charts_the_newest_steps_and_counts_them_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A follower that finds many new steps at once jumps to the newest and reads only the newest
    manifests for the charts; the "committed" tile still counts every committed step it found
    (a follower that catches up late once counted only the newest 64 commits)."""
    monkeypatch.setattr(live, "STEP_THROUGH", 2)
    monkeypatch.setattr(live, "MAX_NEW_MANIFESTS", 4)
    url = str(tmp_path / "store")
    trainer = DemoRun(ds.open_store(url), DemoOptions(store_url=url, model="tiny", steps=9, step_interval=0.0))
    _run_until_done(trainer)
    steps = ds.DeltaFetcher(ds.open_store(url)).steps()
    follower = DemoRun(ds.open_store(url), DemoOptions(store_url=url, train=False, poll_interval=0.05))
    _follow_until(follower, steps[-1])
    snap = follower.board.snapshot()
    assert [c["step"] for c in snap["commits"]] == steps[-4:]  # the newest manifests only
    assert snap["known"] == {"training": len([s for s in steps if s > 0]), "initial": 1}
    assert snap["applied_steps"] == [steps[-1]]  # jumped: the skipped steps were never held


def test_loop_empties_the_store_and_trains_again() -> None:
    store = ds.MemoryStore()
    prepare_demo_store(store)  # what `deltasync demo` does to the store it trains in
    # two runs, then the loop ends: the store and the page are read once quiet, at the second run
    opts = DemoOptions(store_url="memory://l", model="tiny", steps=3, step_interval=0.0, loop=0.01)
    run = DemoRun(store, opts, runs=2)
    ended: list[Episode] = []
    run.on_run_end(ended.append)

    async def collect() -> list[dict[str, Any]]:
        sub = run.board.subscribe(asyncio.get_running_loop())
        run.start()
        got: list[dict[str, Any]] = []
        while sum(e["type"] == "snapshot" for e in got) < 2:
            e = await asyncio.wait_for(sub.queue.get(), RUN_TIMEOUT)
            assert e is not None
            got.append(e)
        return got

    try:
        events = asyncio.run(collect())
        # one read of `current`: the second run's number and its own finished flag, never the first's
        assert _wait_for(lambda: (ep := run.current).number == 1 and ep.finished.is_set())
    finally:
        run.stop()
    snap = run.board.snapshot()
    # the first run finished bit-exact before the page was told to start over
    assert any(e["type"] == "status" and e["data"]["status"] == "done" for e in events)
    reset = events[-1]
    assert reset["type"] == "snapshot" and reset["data"]["commits"] == []
    # the page's new snapshot already names the new run, with nothing of the old one's result
    assert reset["data"]["episode"] == 1 and reset["data"]["bit_exact"] is None and reset["data"]["trainer"] is None
    assert run.current.number == 1  # runs=2: no third run started
    # each run's end was reported once, with the page as that run ended (the terminal's summary)
    assert [ep.number for ep in ended] == [0, 1]
    for ep in ended:
        assert ep.result is not None and ep.result["episode"] == ep.number
        assert ep.result["bit_exact"] is True and ep.result["applied"]["step"] == 3
        steps_seen = [c["step"] for c in ep.result["commits"]]
        assert steps_seen[0] == 0 and steps_seen[-1] == 3 and steps_seen == sorted(set(steps_seen))
    assert snap["episode"] == 1 and snap["bit_exact"] is True and snap["status"] == "done"
    assert run.bit_exact is True and snap["error"] is None
    steps = ds.DeltaFetcher(store).steps()
    # the store was emptied: the second run starts at step 0 again (the uploader may coalesce a
    # step while the store is busy, so not every step need be there)
    assert steps[0] == 0 and steps[-1] == 3
    assert [c["step"] for c in snap["commits"]] == steps
    assert store.exists(DEMO_MARKER)  # emptied, but still the demo's


def test_board_reset_sets_the_new_runs_facts_in_the_same_snapshot() -> None:
    async def main() -> list[dict[str, Any]]:
        board = LiveBoard({"mode": "self-contained", "episode": 0, "bit_exact": None})
        board.set_info(bit_exact=True)
        board.set_status("done")
        sub = board.subscribe(asyncio.get_running_loop())
        board.reset(episode=1, signal="x")
        got = [await asyncio.wait_for(sub.queue.get(), 5) for _ in range(2)]
        board.close()
        return [g for g in got if g is not None]

    first, reset = asyncio.run(main())
    assert first["data"]["episode"] == 0 and first["data"]["bit_exact"] is True
    data = reset["data"]
    assert (data["episode"], data["bit_exact"], data["status"], data["signal"]) == (1, None, "starting", "x")
    assert reset["seq"] == data["seq"] > first["data"]["seq"]


def test_loop_refuses_to_empty_a_store_the_demo_did_not_create() -> None:
    store = ds.MemoryStore()
    store.put("steps/000000000007/manifest.json", b"someone's run")
    run = DemoRun(store, DemoOptions(store_url="memory://x", model="tiny", steps=1, step_interval=0.0, loop=0.01))
    try:
        with pytest.raises(DemoError, match="not created by the demo"):
            run.restart()
    finally:
        run.stop()
    assert [o.key for o in store.list()] == ["steps/000000000007/manifest.json"]


def _wait_for(pred: Any, timeout: float = RUN_TIMEOUT) -> bool:
    ev = threading.Event()
    deadline = threading.Timer(timeout, ev.set)
    deadline.start()
    try:
        while not ev.is_set():
            if pred():
                return True
            ev.wait(0.05)
        return bool(pred())
    finally:
        deadline.cancel()


def test_follower_on_an_empty_store_waits_without_error() -> None:
    run = DemoRun(ds.MemoryStore(), DemoOptions(store_url="memory://e", train=False, poll_interval=0.02))
    run.start()
    try:
        assert _wait_for(lambda: len(run.board.snapshot()["lag"]) >= 1, 10)
    finally:
        run.stop()
    snap = run.board.snapshot()
    assert snap["status"] == "waiting for a trainer" and snap["error"] is None and snap["applied"] is None


def test_follower_shows_an_inventory_mismatch_and_keeps_serving(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    _run_until_done(DemoRun(ds.open_store(url), DemoOptions(store_url=url, model="tiny", steps=2, step_interval=0.0)))
    store = ds.open_store(url)
    store.put(DEMO_KEY, json.dumps({"model": "small"}).encode())  # lies about the model
    run = DemoRun(store, DemoOptions(store_url=url, train=False, poll_interval=0.02))
    run.start()
    try:
        assert _wait_for(lambda: run.board.error is not None, 60)
    finally:
        run.stop()
    assert "InventoryMismatch" in str(run.board.error)
    assert run.board.applied_step is None


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"steps": 0}, "--steps"),
        ({"lr": 0.0}, "--lr"),
        ({"anchor_every": 0}, "--anchor-every"),
        ({"step_interval": -1.0}, "--step-interval"),
        ({"loop": -1.0}, "--loop must be"),
        ({"loop": 5.0, "train": False}, "cannot be combined with --no-train"),
        ({"loop": 5.0, "store_url": "s3://bucket/run"}, "local store only"),
    ],
)
def test_bad_options_raise_demo_error(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(DemoError, match=match):
        DemoOptions(**{"store_url": "x", **kw})


# ------------------------------------------------------------------ app


def test_prepare_store_resets_only_a_store_the_demo_created(tmp_path: Path) -> None:
    from spaces_demo.app import prepare_store

    other = tmp_path / "mine"
    other.mkdir()
    (other / "precious.txt").write_text("keep")
    with pytest.raises(DemoError, match="not created by the demo"):
        prepare_store(str(other), wipe=True)
    assert sorted(os.listdir(other)) == ["precious.txt"] and (other / "precious.txt").read_text() == "keep"
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageError, match="is a file"):
        prepare_store(str(tmp_path / "file"), wipe=True)
    # a run that looks like a demo's (demo.json, steps) but lacks the marker is someone else's
    run = tmp_path / "run"
    store = ds.open_store(str(run))
    store.put(DEMO_KEY, b"{}")
    store.put("steps/000000000000/manifest.json", b"{}")
    with pytest.raises(DemoError, match="pass --store with a new path or an empty directory"):
        prepare_store(f"file://{run}", wipe=True)
    assert [o.key for o in store.list()] == [DEMO_KEY, "steps/000000000000/manifest.json"]
    # an empty dir (or a new path) becomes the demo's: marked, then reset on the next start
    empty = tmp_path / "empty"
    empty.mkdir()
    prepare_store(str(empty), wipe=True).close()
    store = ds.open_store(str(empty))
    assert [o.key for o in store.list()] == [DEMO_MARKER]
    store.put(DEMO_KEY, b"{}")
    store.put("steps/000000000000/manifest.json", b"{}")
    prepare_store(str(empty), wipe=False)  # a follower never resets
    assert len(store.list()) == 3
    prepare_store(f"file://{empty}", wipe=True)
    assert [o.key for o in store.list()] == [DEMO_MARKER]
    prepare_store(str(tmp_path / "new" / "path"), wipe=True)
    assert sorted(os.listdir(tmp_path / "new" / "path")) == [".deltasync-demo", ".deltasync-tmp"]


def test_app_serves_page_assets_and_state() -> None:
    from fastapi.testclient import TestClient

    from spaces_demo.app import create_app

    run = DemoRun(ds.MemoryStore(), DemoOptions(store_url="memory://a", train=False))
    with TestClient(create_app(run, start=False)) as client:
        page = client.get("/")
        assert page.status_code == 200 and 'id="generation"' in page.text
        for asset in ("/static/app.js", "/static/style.css"):
            r = client.get(asset)
            assert r.status_code == 200 and len(r.content) > 1000
        # nothing is loaded from another host
        assert "http" not in page.text.replace("http://www.w3.org", "")
        assert "https://" not in client.get("/static/app.js").text
        state = client.get("/api/state").json()
        assert state["mode"] == "follower" and state["prompt"] == PROMPT and state["commits"] == []
        assert client.get("/healthz").json() == {"ok": True, "status": "starting"}


def test_the_terminal_prints_every_answer_the_page_lists_with_its_step() -> None:
    """Many answer changes (and a --loop restart) between two rounds of the terminal's loop:
    none is skipped, and each line names the step the page's answer history shows (where the
    answer first appeared), with the staleness right after that apply."""
    from spaces_demo.app import _console

    run = DemoRun(ds.MemoryStore(), DemoOptions(store_url="memory://c", train=False))
    board = run.board
    lines: list[str] = []
    stop_console = _console(run, lines.append, None)
    page: list[tuple[int, str]] = []
    try:
        board.set_head(0)
        board.applied(0, text="a", sync_ms=1.0)
        for step, text in [(1, "a"), (2, "b"), (3, "c"), (4, "c"), (5, "d")]:
            board.set_head(step + 2)  # the trainer is ahead: the copy lags 2 steps after each apply
            board.applied(step, text=text, sync_ms=2.0)
        page = [(g["step"], g["text"]) for g in board.snapshot()["generations"]]
        board.reset(episode=1)  # --loop: the next run starts at step 0 again
        board.set_head(0)
        board.applied(0, text="e", sync_ms=3.0)
    finally:
        stop_console()  # its last round, once stopped, prints what is queued
    assert page == [(0, "a"), (2, "b"), (3, "c"), (5, "d")]
    assert [(int(ln.split()[1]), ln.split("answers ")[1]) for ln in lines] == [
        (s, repr(t)) for s, t in [*page, (0, "e")]
    ]
    assert lines[0] == "step    0  applied in 1.0 ms  (lag 0 steps)  inference copy answers 'a'"
    assert lines[1] == "step    2  applied in 2.0 ms  (lag 2 steps)  inference copy answers 'b'"


def _commit(step: int, kind: str = "patch", nbytes: int = 10) -> dict[str, Any]:
    return {"step": step, "kind": kind, "nbytes": nbytes, "full_bytes": 100}


def test_the_summary_counts_training_steps_by_the_newest_step_not_by_commits() -> None:
    """400 training steps commit steps 0..400; one folded into the next commit (the store was busy) leaves
    400 commits, and the summary still says 400 training steps, and that one was folded (issue 31)."""
    from spaces_demo.summary import end_of_run_lines

    every = [_commit(0, "anchor", 1000)] + [_commit(s) for s in range(1, 401)]
    snap: dict[str, Any] = {"applied": {"step": 400}, "bit_exact": True}
    line = end_of_run_lines({**snap, "commits": every}, None)[0]
    assert line == (
        "run finished: 400 training steps (+ initial weights at step 0), 401 commits; "
        "inference copy at step 400, bit-exact with the trainer's"
    )
    one_folded = [c for c in every if c["step"] != 399]
    line = end_of_run_lines({**snap, "commits": one_folded}, None)[0]
    assert line.startswith("run finished: 400 training steps (+ initial weights at step 0), 400 commits (1 step folded")
    three = [c for c in every if c["step"] not in (7, 8, 200)]
    assert "398 commits (3 steps folded into later commits); " in end_of_run_lines({**snap, "commits": three}, None)[0]
    # a follower that joined at step 100 saw commits 100..400 only: nothing was folded
    joined = [c for c in every if c["step"] >= 100]
    assert (
        "400 training steps (+ initial weights at step 0), 301 commits; "
        in end_of_run_lines({**snap, "commits": joined}, None)[0]
    )
    assert end_of_run_lines({"commits": [], "status": "failed", "error": "x"}, None)[0].startswith(
        "run finished: 0 training steps (+ initial weights at step 0), 0 commits; "
    )
