"""``deltasync replica-token --run NAME --replica ID [--signal URL]``: a replica's report credential."""

from __future__ import annotations

import argparse
import os

from deltasync.errors import DeltaSyncError

__all__ = ["DESCRIPTION", "EPILOG", "NAME", "SUMMARY", "add_arguments", "run"]

NAME = "replica-token"
SUMMARY = "print the token that binds a replica id to its fleet reports (docs/fleet.md)"
DESCRIPTION = """
        Print the replica token of replica ID of run NAME: give it to that replica's receiver as
        DELTASYNC_REPORT_TOKEN (`deltasync follow`, `follow --vllm --replica ID`, the vLLM backend).
        Its reports are then bound to it: no holder of the shared report or subscribe token can
        report, overwrite or remove that replica id, and the fleet decides agreement among bound
        replicas. It covers ID and every ID-<suffix> (`follow --vllm --replica node3` reports
        node3-0, node3-1, ...). Offline, the token is made with the server's key: DELTASYNC_REPLICA_KEY,
        else the publish token DELTASYNC_PUBLISH_TOKEN (the server derives its key from it when it has
        no replica key). With --signal, the server mints it (publish token needed).
        """
EPILOG: str | None = """
        examples:
          DELTASYNC_REPORT_TOKEN=$(deltasync replica-token --run r1 --replica node3) deltasync follow ...
          deltasync replica-token --run r1 --replica node3 --signal http://trainer:8000
        """


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``deltasync replica-token``."""
    p.add_argument("--run", required=True, metavar="NAME", help="the run's name at the signal server")
    p.add_argument("--replica", required=True, metavar="ID", help="the replica id (it also covers ID-<suffix>)")
    p.add_argument(
        "--signal", metavar="URL", help="ask this signal server to mint it (else it is made here, from the key)"
    )


def run(args: argparse.Namespace) -> int:
    """Print the token (one line)."""
    from deltasync.signal import SignalClient, replica_key, replica_token

    publish = os.environ.get("DELTASYNC_PUBLISH_TOKEN") or None
    if args.signal is not None:
        if publish is None:
            raise DeltaSyncError("--signal needs DELTASYNC_PUBLISH_TOKEN: minting a replica token is a publish action")
        with SignalClient(args.signal, publish) as client:
            print(client.replica_token(args.run, args.replica))
        return 0
    key = replica_key(os.environ.get("DELTASYNC_REPLICA_KEY") or None, publish)
    if key is None:
        raise DeltaSyncError(
            "no key to make a replica token with: set DELTASYNC_REPLICA_KEY (the signal server's) or "
            "DELTASYNC_PUBLISH_TOKEN (when the server has no replica key), or pass --signal URL"
        )
    print(replica_token(key, args.run, args.replica))
    return 0
