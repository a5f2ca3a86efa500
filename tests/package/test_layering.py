"""Import layering: protocol <- storage <- uploader/fetcher <- server (DESIGN.md, "Dependency direction")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _modules_after(imports: str) -> list[str]:
    """The deltasync / fastapi modules a fresh interpreter holds after ``imports``."""
    code = (
        f"import sys\n{imports}\n"
        "import json\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('deltasync', 'fastapi', 'starlette'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    loaded: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
    return loaded


def _server_side(loaded: list[str]) -> list[str]:
    return [m for m in loaded if m == "deltasync.server" or m.startswith(("deltasync.server.", "fastapi", "starlette"))]


@pytest.mark.parametrize(
    "imports",
    [
        "import deltasync.uploader",
        "import deltasync.fetcher",
        "import deltasync.uploader, deltasync.fetcher, deltasync.fetcher._follow, deltasync.uploader._uploader",
        "import deltasync.signal",
        # the signal client is imported lazily: exercise those code paths too (nothing listens on port 9)
        "import threading\n"
        "from deltasync import DeltaFetcher, DeltaUploader\n"
        "from deltasync.storage import MemoryStore\n"
        "DeltaUploader(MemoryStore('up'), signal_url='http://127.0.0.1:9').close()\n"
        "stop = threading.Event()\n"
        "stop.set()\n"
        "DeltaFetcher(MemoryStore('down')).follow({}, signal_url='http://127.0.0.1:9', run='r', stop=stop)",
    ],
)
def test_trainer_and_inference_sides_do_not_import_the_server(imports: str) -> None:
    loaded = _modules_after(imports)
    assert any(m.startswith("deltasync.") for m in loaded)
    assert _server_side(loaded) == [], f"{imports!r} pulled in the server side"
    if "signal_url" in imports:
        assert "deltasync.signal._client" in loaded  # the lazy imports really ran


def test_signal_client_is_the_same_object_through_the_compat_path() -> None:
    import deltasync.server.client as compat
    import deltasync.signal as signal

    assert compat.SignalClient is signal.SignalClient
    assert compat.Notifier is signal.Notifier
    assert compat.CommitEvent is signal.CommitEvent
