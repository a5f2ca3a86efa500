"""RunReader.revalidate: a long-lived reader notices a store emptied and written again under it.

Manifests are written once, so a reader caches them for its life; ``deltasync demo --loop``
empties its store and trains again, writing the same steps with other content. These runs
are written by the real uploader into a real local store; the "emptying" is what the demo
does (:func:`spaces_demo.live.prepare_demo_store` deletes every object but its marker).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gc_support import make_states
from spy_store import SpyStore

import deltasync as ds
from deltasync.protocol import manifest_key
from deltasync.run import RunReader
from deltasync.storage import Store


def write_run(store: Store, steps: int, seed: int) -> dict[int, str]:
    """Commit steps 0..steps-1 of a fresh run; their manifest digests."""
    states: list[dict[str, Any]] = make_states(steps, seed=seed)
    with ds.DeltaUploader(store, anchor_every=50) as up:
        for step, state in enumerate(states):
            up.push(state, step).result()
    reader = RunReader(store)
    return {s: reader.committed(s).digest for s in reader.steps()}


def empty(store: Store) -> None:
    store.delete_many([o.key for o in store.list("")])


def test_revalidate_is_true_while_the_store_holds_the_cached_manifest(tmp_path: Path) -> None:
    store = SpyStore(ds.open_store(str(tmp_path / "run")))
    digests = write_run(store, 3, seed=0)
    reader = RunReader(store)
    assert reader.latest_step() == 2
    store.reset()
    assert reader.revalidate(2) is True
    assert store.gets == [manifest_key(2)]  # one read, the step's manifest
    store.reset()
    assert reader.committed(2).digest == digests[2] and store.gets == []  # still cached
    assert reader.revalidate(7) is True and store.gets == []  # nothing cached for it: nothing read


def test_a_store_emptied_and_written_again_is_noticed_and_read_afresh(tmp_path: Path) -> None:
    store = ds.open_store(str(tmp_path / "run"))
    old = write_run(store, 4, seed=0)
    reader = RunReader(store)
    assert reader.latest_step() == 3
    assert reader.committed(1).digest == old[1]

    empty(store)
    new = write_run(store, 2, seed=1)  # another run: steps 0 and 1 again, other content
    assert new[0] != old[0] and new[1] != old[1]
    # the cache still answers with the old run: that is what revalidate is for
    assert reader.committed(1).digest == old[1]
    assert reader.revalidate(1) is False
    assert reader.committed(1).digest == new[1]
    assert reader.committed(0).digest == new[0]  # every cached manifest was dropped, not only step 1's
    assert reader.latest_step() == 1 and reader.steps() == [0, 1]
    assert reader.revalidate(1) is True


def test_a_step_gone_from_an_emptied_store_drops_the_cache(tmp_path: Path) -> None:
    store = ds.open_store(str(tmp_path / "run"))
    write_run(store, 3, seed=0)
    reader = RunReader(store)
    assert reader.latest_step() == 2
    empty(store)
    assert reader.latest_step() == 2  # listings only look past the newest known step
    assert reader.revalidate(2) is False
    assert reader.latest_step() is None and reader.steps() == []
