"""The phase of one driven server (:class:`~deltasync.serving.session.ServerSession`) and the moves between them.

A phase says what the driver can do with a server next; the fleet view's state of that server
(:func:`deltasync.serving.fleet.server_state`) is derived from it, its last update and its audit::

    UNINITIALISED --set up--> READY <--refused / retried--> BACKING_OFF
          |                     |  \\--lost its weights, or paused as diverged--> NEEDS_REPLACEMENT
          |                     |                                                   |
          +--no answer--> UNREACHABLE  <-----------------(any phase)----------------+
          +--an error---> FAILED  --set up again at the next observation--> READY

A server that is unreachable or failed is set up again (``init``) at the next observation: it may be
a new process on the same URL. One that needs replacement is only probed for a new process (another
weight version, or it went away and came back): its weights are neither step, it is never updated.
"""

from __future__ import annotations

import enum

__all__ = ["TRANSITIONS", "Phase"]


class Phase(enum.Enum):
    """Where one driven server stands (see the module doc)."""

    #: not set up yet, or a new process on its URL (its backend is not pointed at the store)
    UNINITIALISED = "uninitialised"
    #: its last call got no whole answer within its deadline; set up again once it answers
    UNREACHABLE = "unreachable"
    #: it answered its set-up or a probe with an error, or with something that is not its API
    FAILED = "failed"
    #: set up, serving its step; updated to newer ones
    READY = "ready"
    #: it refused a step (it still serves its previous one): that step is tried again after a backoff
    BACKING_OFF = "backing_off"
    #: its weights are neither step (or it was paused as diverged): never updated again until restarted
    NEEDS_REPLACEMENT = "needs_replacement"


_ANY_LIVE = frozenset({Phase.READY, Phase.BACKING_OFF, Phase.NEEDS_REPLACEMENT, Phase.UNINITIALISED})
_SET_UP = frozenset({Phase.UNINITIALISED, Phase.READY, Phase.UNREACHABLE, Phase.FAILED, Phase.NEEDS_REPLACEMENT})

#: the moves the driver makes (a move to the phase a server is in is a new outcome of that phase)
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    # an update answered by a server not probed since (an all-or-nothing rollout's) may find it lost
    Phase.UNINITIALISED: _SET_UP,
    Phase.UNREACHABLE: _SET_UP,
    Phase.FAILED: _SET_UP,
    Phase.READY: _ANY_LIVE | {Phase.UNREACHABLE, Phase.FAILED},
    Phase.BACKING_OFF: _ANY_LIVE | {Phase.UNREACHABLE, Phase.FAILED},
    # only a new process brings it back (probed: another weight version, or gone and back); an error
    # answered to a probe leaves it where it is
    Phase.NEEDS_REPLACEMENT: frozenset({Phase.NEEDS_REPLACEMENT, Phase.UNINITIALISED, Phase.UNREACHABLE}),
}
