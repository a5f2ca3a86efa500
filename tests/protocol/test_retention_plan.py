"""The pure retention planner (``deltasync.protocol.retention``): hand-built manifests, an injected clock.

Notation: ``A0`` an anchor at step 0, ``P3<-2`` a patch at step 3 whose parent is 2.
Every test states the rule it pins down; nothing here touches a store.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from deltasync.errors import ProtocolError, UnsupportedVersion
from deltasync.protocol import Committed, FileInfo, Manifest, Stats, TensorInfo, Writer, WriterClaim, inventory_digest
from deltasync.protocol.retention import (
    Lease,
    RetentionPlan,
    describe_kept,
    lease_key,
    parse_lease_key,
    plan_retention,
)

INVENTORY = (TensorInfo("w", "BF16", (2, 2)),)
NOW = 1_000_000.0
HOUR = 3600.0


@dataclass(frozen=True)
class Obj:
    key: str
    size: int
    mtime: float | None = NOW - 10 * HOUR


class Run:
    """Committed manifests plus the listing a store would return for them."""

    def __init__(self) -> None:
        self.committed: dict[int, Committed] = {}
        self.listing: list[Obj] = [Obj("HEAD.json", 90), Obj("writers/000000000001.json", 80)]
        self.claims: list[WriterClaim] = []
        self.leases: dict[str, Lease | None] = {}

    def add(self, step: int, kind: str, parent: int | None, epoch: int = 1, size: int = 100) -> Run:
        p = self.committed.get(parent) if parent is not None else None
        name = "model-00001-of-00001.safetensors" if kind == "anchor" else "patch-00000.safetensors"
        m = Manifest(
            run_id="run",
            step=step,
            kind=kind,  # type: ignore[arg-type]
            parent_step=parent,
            parent_digest=p.digest if p else None,
            anchor_step=step if kind == "anchor" else (p.manifest.anchor_step if p else 0),
            inventory=INVENTORY,
            inventory_digest=inventory_digest(INVENTORY),
            files=(FileInfo(name, size, "00" * 16),),
            entries=(),
            tensor_digests={},
            stats=Stats(0, 4, size),
            writer=Writer("w", epoch) if epoch else None,
        )
        self.committed[step] = Committed(m, f"{step:032x}")
        self.listing += [Obj(f"steps/{step:012d}/manifest.json", 50), Obj(f"steps/{step:012d}/{name}", size)]
        return self

    def chain(self, first: int, last: int, anchor_every: int) -> Run:
        """Steps first..last, an anchor every ``anchor_every`` steps (first is one)."""
        for s in range(first, last + 1):
            if (s - first) % anchor_every == 0:
                self.add(s, "anchor", s - 1 if s > first else None)
            else:
                self.add(s, "patch", s - 1)
        return self

    def span(self, a: int, b: int, *, manifest: bool = True, mtime: float = NOW - 10 * HOUR) -> Run:
        folder = f"spans/{a:012d}-{b:012d}/"
        if manifest:
            self.listing.append(Obj(folder + "manifest.json", 40, mtime))
        self.listing.append(Obj(folder + "patch-00000.safetensors", 30, mtime))
        return self

    def plan(self, k: int, now: float = NOW, grace: float = HOUR) -> RetentionPlan:
        return plan_retention(
            self.listing, self.committed, self.claims, self.leases, now=now, keep_anchors=k, grace=grace
        )


def steps_of(keys: tuple[str, ...] | frozenset[str]) -> set[int]:
    return {int(k.split("/")[1]) for k in keys if k.startswith("steps/")}


def test_keeps_last_k_anchors_and_everything_after_the_oldest_kept_one() -> None:
    # A0..P9 A10..P19 A20..P29 A30..P34
    run = Run().chain(0, 34, 10)
    plan = run.plan(2)
    assert plan.floor == 20 and plan.anchors == (0, 10, 20, 30)
    assert plan.deleted_steps == tuple(range(20))
    assert sorted(plan.kept) == list(range(20, 35))
    assert plan.kept[34] == "newest committed step"
    assert plan.kept[30] == "one of the last 2 anchor(s)"
    assert "oldest kept anchor 20" in plan.kept[21]
    # manifests go first, then the data files; HEAD and writers/ are never in the plan
    assert {k.rsplit("/", 1)[1] for k in plan.first} == {"manifest.json"}
    assert steps_of(plan.first) == steps_of(plan.then) == set(range(20))
    assert not any(k.startswith(("HEAD", "writers/")) for k in plan.keys)
    assert plan.delete_bytes == 20 * 150 and plan.keep_bytes == 15 * 150


def test_k_larger_than_the_anchors_deletes_no_committed_step() -> None:
    run = Run().chain(0, 14, 5)
    assert run.plan(3).deleted_steps == ()
    assert run.plan(100).keys == frozenset()
    assert run.plan(2).deleted_steps == tuple(range(5))


def test_k_must_be_positive() -> None:
    run = Run().chain(0, 4, 5)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="keep_anchors"):
            run.plan(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="grace"):
        run.plan(1, grace=-1)


def test_k1_keeps_the_newest_anchor_chain_and_the_newest_step() -> None:
    run = Run().chain(0, 12, 5)  # A0 A5 A10, newest P12
    plan = run.plan(1)
    assert plan.floor == 10 and set(plan.kept) == {10, 11, 12}


def test_no_anchor_means_nothing_is_reclaimed() -> None:
    run = Run().add(3, "patch", None).add(4, "patch", 3)  # a broken run: patches without an anchor
    plan = run.plan(1)
    assert plan.keys == frozenset() and plan.floor is None
    assert set(plan.kept) == {3, 4}


def test_a_held_lease_keeps_every_step_from_its_step_on() -> None:
    run = Run().chain(0, 29, 10)
    run.leases[lease_key("lagging")] = Lease("lagging", step=4, target=None, expires=int(NOW) + 60)
    plan = run.plan(1)
    # the holder at 4 may go forward one step at a time: 5..9, the anchor 10, 11...
    assert set(plan.kept) == set(range(4, 30))
    assert plan.kept[4] == "lease lagging holds step 4 (expires in 60 s)"
    assert plan.kept[20] == "one of the last 1 anchor(s)"
    assert plan.deleted_steps == (0, 1, 2, 3)


def test_a_target_lease_keeps_the_targets_chain_down_to_its_anchor() -> None:
    run = Run().chain(0, 29, 10)
    run.leases[lease_key("pinned")] = Lease("pinned", step=None, target=13, expires=int(NOW) + 1)
    plan = run.plan(1)
    assert {10, 11, 12, 13} <= set(plan.kept) and 14 not in plan.kept
    assert "is fetching step 13" in plan.kept[12]


def test_expired_leases_protect_nothing_and_are_deleted() -> None:
    run = Run().chain(0, 19, 10)
    key = lease_key("gone")
    run.leases[key] = Lease("gone", step=3, target=5, expires=int(NOW))  # expires == now: expired
    run.listing.append(Obj(key, 70))
    plan = run.plan(1)
    assert plan.expired_leases == (key,) and key in plan.then
    assert plan.deleted_steps == tuple(range(10))
    # one second earlier the same lease still held 3..9 and fetched 5 (from the anchor 0)
    assert set(run.plan(1, now=NOW - 1).kept) == set(range(20))


def test_an_unparseable_lease_is_left_alone_and_protects_nothing() -> None:
    run = Run().chain(0, 19, 10)
    key = lease_key("junk")
    run.listing.append(Obj(key, 3))
    run.leases[key] = None
    plan = run.plan(1)
    assert key not in plan.keys and any("does not parse" in n for n in plan.notes)
    assert plan.deleted_steps == tuple(range(10))


def test_leases_on_steps_that_are_not_committed_are_ignored() -> None:
    run = Run().chain(0, 19, 10)
    run.leases[lease_key("x")] = Lease("x", step=77, target=99, expires=int(NOW) + 100)
    assert run.plan(1).deleted_steps == tuple(range(10))


def test_superseded_steps_below_the_floor_go_and_do_not_count_as_anchors() -> None:
    # writer 1: A0 P1 P2; writer 2 claims after step 1 and writes A3..; writer 1's late P2 is superseded,
    # and so is its late anchor A5 (it must not count among the kept anchors)
    run = Run().add(0, "anchor", None).add(1, "patch", 0).add(2, "patch", 1)
    run.add(3, "anchor", None, epoch=2).add(4, "patch", 3, epoch=2).add(5, "anchor", None, epoch=1)
    run.add(6, "anchor", 4, epoch=2).add(7, "patch", 6, epoch=2)
    run.claims = [WriterClaim(1, "w1", None), WriterClaim(2, "w2", 1)]
    plan = run.plan(2)
    assert plan.anchors == (0, 3, 6) and plan.floor == 3
    assert plan.deleted_steps == (0, 1, 2)  # superseded 2 goes with the rest below the floor
    assert 5 in plan.kept  # superseded but above the floor: stays
    assert run.plan(1).deleted_steps == (0, 1, 2, 3, 4, 5)


def test_the_newest_step_stays_even_when_superseded_below_the_floor() -> None:
    run = Run().add(0, "anchor", None, epoch=2).add(1, "anchor", 0, epoch=2).add(9, "patch", 0, epoch=1)
    run.claims = [WriterClaim(2, "w2", None)]
    plan = run.plan(1)
    assert plan.floor == 1 and 9 in plan.kept and plan.deleted_steps == (0,)


def test_orphan_folders_go_only_when_older_than_grace_and_below_the_newest_anchor() -> None:
    run = Run().chain(0, 9, 10).chain(20, 24, 10)  # newest anchor 20; nothing committed at 10-19
    run.listing += [
        Obj("steps/000000000030/patch-00000.safetensors", 7),  # above the newest anchor: never
        Obj("steps/000000000015/patch-00000.safetensors", 7),  # old orphan below it: goes
        Obj("steps/000000000016/patch-00000.safetensors", 7, NOW - 60),  # young: stays
        Obj("steps/000000000017/patch-00000.safetensors", 7, None),  # age unknown: stays
        Obj("steps/000000000018/a.safetensors", 7),  # one old file ...
        Obj("steps/000000000018/b.safetensors", 7, NOW - 5),  # ... and a young one: the folder stays
    ]
    plan = run.plan(2)
    assert plan.orphans == ("steps/000000000015/patch-00000.safetensors",)
    assert any("younger than the 3600 s grace" in n for n in plan.notes)
    assert any("no modification time" in n for n in plan.notes)
    # with a shorter grace (or a later clock) the young ones go too
    later = run.plan(2, now=NOW + 2 * HOUR)
    assert steps_of(later.orphans) == {15, 16, 18}


def test_keys_outside_the_layout_are_never_deleted() -> None:
    run = Run().chain(0, 19, 10)
    foreign = [
        "README.md",
        "steps/notes.txt",
        "steps/000000000001/sub/dir.bin",
        "steps/000000000001/.hidden",
        "steps/00000000001/manifest.json",  # eleven digits
        "spans/000000000005-000000000003/manifest.json",  # from > to
        "spans/x/manifest.json",
        "leases/.bad.json",
        "other/steps/000000000001/manifest.json",
    ]
    run.listing += [Obj(k, 1) for k in foreign]
    plan = run.plan(1, now=NOW + 100 * HOUR)
    assert plan.deleted_steps == tuple(range(10))
    assert not set(foreign) & plan.keys
    assert any("outside the run's layout" in n for n in plan.notes)


def test_writer_subfolders_go_with_their_step_or_span_folder() -> None:
    """Data files in writers' subfolders (``w<writer id>/<name>``, SPEC.md "Commit rule") belong to
    their step's (or span's) folder: a collected step loses them all, the winner's and a fenced
    writer's leftovers alike, manifest first; an orphan folder loses them after the grace."""
    run = Run().chain(0, 9, 10).chain(20, 29, 10)  # nothing committed at 10-19
    nested = {
        "steps/000000000003/wab12/patch-00000.safetensors",  # the committed step's own files
        "steps/000000000003/wab12/patch-00001.safetensors",
        "steps/000000000003/wcd34/patch-00000.safetensors",  # a fenced writer's leftover
        "steps/000000000000/wab12/model-00001-of-00001.safetensors",
        "steps/000000000000/wab12/model.safetensors.index.json",
        "spans/000000000000-000000000005/wab12/patch-00000.safetensors",
    }
    orphan = "steps/000000000015/wcd34/patch-00000.safetensors"  # no manifest, below the newest anchor 20
    kept = {"steps/000000000022/wab12/patch-00000.safetensors", "spans/000000000020-000000000025/wab12/p.bin"}
    run.listing += [Obj(k, 5) for k in [*sorted(nested), orphan, *sorted(kept)]]
    run.span(0, 5).span(20, 25)
    plan = run.plan(1)
    assert plan.deleted_steps == tuple(range(10)) and plan.deleted_spans == ((0, 5),)
    assert nested <= set(plan.then) and plan.orphans == (orphan,)
    assert not kept & plan.keys
    assert set(plan.first) == {f"steps/{s:012d}/manifest.json" for s in range(10)} | {
        "spans/000000000000-000000000005/manifest.json"
    }
    assert all(plan.sizes[k] == 5 for k in nested)


def test_a_manifest_in_a_writer_subfolder_commits_nothing() -> None:
    """``steps/N/w<id>/manifest.json`` is no step manifest (nor a valid data file name): the folder
    holding only it is not committed, and the key is left alone as outside the layout."""
    run = Run().chain(0, 19, 10)
    odd = ["steps/000000000005/wab12/manifest.json", "steps/000000000030/wab12/manifest.json"]
    run.listing += [Obj(k, 1) for k in odd]
    plan = run.plan(1, now=NOW + 100 * HOUR)
    assert 30 not in plan.kept and not set(odd) & plan.keys
    assert any("2 key(s) outside the run's layout" in n for n in plan.notes)


def test_an_unreadable_manifest_keeps_its_step() -> None:
    run = Run().chain(0, 19, 10)
    del run.committed[3]  # listed, but it did not parse (or a bad signature)
    plan = run.plan(1)
    assert 3 not in plan.deleted_steps and "could not be read" in plan.kept[3]


def test_spans_stay_while_both_ends_stay() -> None:
    run = Run().chain(0, 29, 10)
    run.span(0, 9).span(10, 19).span(12, 25).span(20, 29).span(0, 5, manifest=False)
    run.span(5, 8, manifest=False, mtime=NOW - 5)  # an in-flight span: young
    plan = run.plan(2)  # floor 10
    assert plan.deleted_spans == ((0, 9),)
    span_keys = {k for k in plan.keys if k.startswith("spans/")}
    assert span_keys == {
        "spans/000000000000-000000000009/manifest.json",
        "spans/000000000000-000000000009/patch-00000.safetensors",
        "spans/000000000000-000000000005/patch-00000.safetensors",  # old orphan span
    }
    assert "spans/000000000000-000000000009/manifest.json" in plan.first
    assert run.plan(1).deleted_spans == ((0, 9), (10, 19), (12, 25))
    run.leases[lease_key("f")] = Lease("f", step=12, target=None, expires=int(NOW) + 5)
    assert run.plan(1).deleted_spans == ((0, 9), (10, 19))  # 12 on is kept now: 12-25 stays


def test_restricting_a_plan_keeps_only_what_both_plans_delete() -> None:
    run = Run().chain(0, 29, 10)
    plan = run.plan(1)
    other = Run().chain(0, 29, 10)
    other.leases[lease_key("late")] = Lease("late", step=5, target=None, expires=int(NOW) + 9)
    again = other.plan(1)
    final = again.restricted_to(plan.keys)
    assert final.deleted_steps == (0, 1, 2, 3, 4)
    assert steps_of(final.keys) == set(final.deleted_steps)
    assert final.delete_bytes == len(final.deleted_steps) * 150


def test_describe_kept_groups_reasons_into_ranges() -> None:
    run = Run().chain(0, 29, 10)
    run.leases[lease_key("lag")] = Lease("lag", step=4, target=None, expires=int(NOW) + 60)
    lines = describe_kept(run.plan(1))
    assert lines == [
        "steps 4-19: lease lag holds step 4 (expires in 60 s)",
        "step 20: one of the last 1 anchor(s)",
        "steps 21-28: at or after the oldest kept anchor 20",
        "step 29: newest committed step",
    ]


def test_lease_round_trip_and_hostile_bytes() -> None:
    lease = Lease.expiring("fetcher-1", 5, 9, now=100.2, ttl=30)
    assert lease.expires == 131
    body = lease.to_json()
    assert body == b'{"expires":131,"format_version":1,"id":"fetcher-1","step":5,"target":9}'
    assert Lease.from_json(body) == lease
    assert parse_lease_key(lease_key("fetcher-1")) == "fetcher-1"
    assert parse_lease_key("leases/a/b.json") is None
    for bad in (
        b"{",
        b"[]",
        b'{"expires":1,"format_version":1,"id":"a","step":5}',
        b'{"expires":1,"format_version":1,"id":"../x","step":null,"target":null}',
        b'{"expires":-1,"format_version":1,"id":"a","step":null,"target":null}',
        b'{"expires":1,"format_version":1,"id":"a","step":true,"target":null}',
        b'{"expires":1,"format_version":1,"id":7,"step":null,"target":null}',
        b'{"expires":1,"format_version":1,"id":"a","step":null,"target":null,"x":1}',
    ):
        with pytest.raises(ProtocolError):
            Lease.from_json(bad)
    with pytest.raises(UnsupportedVersion):
        Lease.from_json(b'{"expires":1,"format_version":2,"id":"a","step":null,"target":null}')
    with pytest.raises(ProtocolError):
        lease_key("a/b")
