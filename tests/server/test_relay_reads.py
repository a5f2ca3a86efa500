"""The relay's reads of a run's commits: :meth:`CommitRelay.commits_after` answers from its cache of
recent commits (scanned from the newest: a follower asks for the last one or two) exactly what the
database holds, whatever the step and the limit, inside the cache and below it."""

from __future__ import annotations

import asyncio

from deltasync.server import Settings, create_app
from deltasync.server._relay import CommitRelay


def test_commits_after_from_the_cache_is_what_the_database_holds() -> None:
    async def main() -> None:
        relay: CommitRelay = create_app(Settings()).state.relay
        db = relay.db
        steps = [2 * i for i in range(300)]  # more than the 256 cached; gaps between steps
        for s in steps:
            relay.publish("r", s, f"{s:032x}", None, None)
        for after in (None, -1, 0, 1, 2, 300, 341, 342, 343, 590, 596, 597, 598, 599, 1000):
            for limit in (1, 2, 3, 1000):
                got = [c.step for c in relay.commits_after("r", after, limit)]
                want = [c.step for c in db.after("r", -1 if after is None else after, limit)]
                assert got == want, (after, limit)
        db.close()

    asyncio.run(main())
