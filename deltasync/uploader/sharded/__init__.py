"""Sharded push: under torch.distributed every rank of the group pushes its own (DTensor) shards.

- :mod:`._push`: :class:`ShardedPush`, the per-rank engine that replaces the uploader's push and commit;
- :mod:`._dtensor`: one rank's local shards of a state dict;
- :mod:`._shardmap`: who owns and writes what (pure functions of the global inventory);
- :mod:`._owner`: the owner ranks' host copies, their files, and rank 0's commit;
- :mod:`._channel`: :class:`RankChannel`, the uploader's own gloo group for metadata and sparse changes.
"""

from deltasync.uploader.sharded._push import ShardedJob, ShardedPush, sharded_wanted

__all__ = ["ShardedJob", "ShardedPush", "sharded_wanted"]
