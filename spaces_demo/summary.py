"""What a demo run cost, from the page's state: the terminal's end-of-run summary.

The page draws the same split (anchor bytes vs patch bytes) from the same commit rows
(see ``costSplit`` in ``static/app.js``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["CostSplit", "cost_split", "end_of_run_lines", "signal_path_line"]


def _fmt_bytes(n: float) -> str:
    units = ["B", "kB", "MB", "GB", "TB"]
    i = 0
    while abs(n) >= 1000 and i < len(units) - 1:
        n /= 1000
        i += 1
    return f"{n:.0f} {units[i]}" if i == 0 else f"{n:.{2 if n < 10 else 1}f} {units[i]}"


class CostSplit:
    """Bytes shipped by the committed steps, split into anchors and patches."""

    def __init__(self, commits: list[dict[str, Any]]) -> None:
        anchors = [c for c in commits if c["kind"] == "anchor"]
        patches = [c for c in commits if c["kind"] == "patch"]
        self.commits = len(commits)
        # step N holds the weights after N training steps (step 0: the initial weights); the uploader
        # may fold a step whose commit would wait on a busy store into the next one, so the newest
        # committed step counts the training steps, not the number of commits
        self.training_steps = max((int(c["step"]) for c in commits), default=0)
        first = min((int(c["step"]) for c in commits), default=0)  # a follower may join mid-run
        #: steps in the committed range with no commit of their own (shipped inside a later commit)
        self.folded = max(0, self.training_steps - first + 1 - self.commits) if commits else 0
        self.anchors = len(anchors)
        self.patches = len(patches)
        self.anchor_bytes = sum(int(c["nbytes"]) for c in anchors)
        self.patch_bytes = sum(int(c["nbytes"]) for c in patches)
        self.full_bytes = sum(int(c["full_bytes"]) for c in commits)

    @property
    def shipped(self) -> int:
        """Every committed step's bytes."""
        return self.anchor_bytes + self.patch_bytes


def cost_split(commits: list[dict[str, Any]]) -> CostSplit:
    """The anchor/patch split of ``commits`` (the live board's timeline rows)."""
    return CostSplit(commits)


def end_of_run_lines(snapshot: dict[str, Any], url: str | None, *, loop: float = 0.0) -> list[str]:
    """The lines the terminal prints once a run has ended (bit-exact check done, or failed).

    ``url``: where the page is still served (None when the process is about to exit).
    """
    c = cost_split(snapshot["commits"])
    applied = (snapshot.get("applied") or {}).get("step")
    if snapshot.get("bit_exact") is True:
        verdict = "bit-exact with the trainer's"
    elif snapshot.get("bit_exact") is False:
        verdict = "NOT bit-exact with the trainer's"
    else:
        verdict = f"failed: {snapshot.get('error') or snapshot.get('status')}"
    full_x = c.full_bytes / max(c.shipped, 1)
    folded = ""
    if c.folded:
        folded = f" ({c.folded} step{'s' if c.folded > 1 else ''} folded into later commits)"
    lines = [
        f"run finished: {c.training_steps} training steps (+ initial weights at step 0), {c.commits} commits"
        f"{folded}; inference copy at step {applied}, {verdict}",
        f"shipped {_fmt_bytes(c.shipped)}: {c.anchors} anchors {_fmt_bytes(c.anchor_bytes)} + "
        f"{c.patches} patches {_fmt_bytes(c.patch_bytes)} (vs {_fmt_bytes(c.full_bytes)} as full checkpoints, "
        f"{full_x:.1f}x less)",
    ]
    if snapshot.get("signal_server"):
        lines.append(signal_path_line(snapshot))
    if url is not None:
        again = f"; a new run starts in {loop:g} s" if loop else ""
        lines.append(f"still serving {url}{again} (Ctrl-C to stop)")
    return lines


def signal_path_line(snapshot: dict[str, Any]) -> str:
    """How the run's steps reached the inference copy (the page's line under the title), and what
    became of the trainer's commit signals, when a signal server is in the loop."""
    paths = snapshot.get("paths") or {}
    line = f"new steps via the signal server: {paths.get('signal', 0)}, via store polling: {paths.get('store', 0)}"
    signals = (snapshot.get("trainer") or {}).get("signals")
    if signals:
        line += (
            f"; the trainer's signals: {signals['sent']} sent, {signals['refused']} refused, {signals['failed']} failed"
        )
    return line
