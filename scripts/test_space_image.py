#!/usr/bin/env python3
"""Build the Space image (the repository's Dockerfile) and check it from running containers.

Without Docker Hub, ``python:3.11-slim`` is replaced by a local stand-in: a minimal Debian bookworm
(debootstrap) with python3.11, pip and venv, imported as ``deltasync-test/python:3.11-slim`` (made
once, needs root and debootstrap; ``--rebuild-base`` makes it again). torch comes from the host's
local CPU wheel (the one ``pip install torch==2.13.0`` resolves here, which must be a local file),
served to the build on 127.0.0.1; everything else comes from PyPI. Builds use ``--network host``.

For each builder (BuildKit and the classic one, ``DOCKER_BUILDKIT=0``) it builds the image and checks:
the user is uid 1000 and the CMD is the demo on 7860; the app dir holds no build/ or *.egg-info; torch
is the CPU build; the s3 and hf store extras import and open; the image's CMD (host/port moved to
127.0.0.1 and a free port) serves the page, its JSON state and SSE stream, and trains a few steps
into ./deltasync-demo (owned by uid 1000); the same CMD with the loop on (a short run, 2 s between
runs instead of the Space's 30) trains two runs in a row, and in each one the in-process signal
server accepts every commit signal and announces steps to the follower. Then, on a SeaweedFS server on 127.0.0.1 (needs the
``test`` extra), one container trains into ``s3://`` and a second follows it through
``DELTASYNC_DEMO_FOLLOW``. Prints the figures (image size, build time, time to first page) and
writes them as JSON with ``--report``.

    sudo python scripts/test_space_image.py [--builders buildkit,classic] [--cache] [--keep]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BASE_TAG = "deltasync-test/python:3.11-slim"
IMAGE = "deltasync-test/space"
TORCH = "torch==2.13.0"  # the Dockerfile's pin
CMD = ["deltasync", "demo", "--host", "0.0.0.0", "--port", "7860"]
APP_DIR = "/home/user/app"


class CheckFailed(Exception):
    """One check of the image did not hold; the message says which."""


def log(msg: str) -> None:
    print(f"[space-image] {msg}", flush=True)


def run(cmd: list[str], *, timeout: float = 600, env: dict[str, str] | None = None, **kw: Any) -> str:
    """Run ``cmd``; its stdout, or CheckFailed with the output tail."""
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, **kw)
    if r.returncode != 0:
        raise CheckFailed(f"{' '.join(cmd)} exited {r.returncode}:\n{(r.stdout + r.stderr)[-4000:]}")
    return r.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------ docker client and the stand-in base


def docker_client() -> str:
    """A docker client that can build with BuildKit and without; CheckFailed when none or no daemon."""
    candidates = [os.environ.get("DELTASYNC_DOCKER") or "", "docker", "/usr/bin/docker"]
    for c in filter(None, dict.fromkeys(candidates)):
        exe = shutil.which(c)
        if exe is None:
            continue
        r = subprocess.run([exe, "version", "--format", "{{.Client.Version}}"], capture_output=True, text=True)
        major = int((r.stdout.strip() or "0").split(".")[0]) if r.stdout.strip()[:1].isdigit() else 0
        has_buildx = subprocess.run([exe, "buildx", "version"], capture_output=True).returncode == 0
        # clients from 23 on build with BuildKit only through the buildx plugin; older ones have it built in
        if not (has_buildx or 0 < major < 23):
            continue
        info = subprocess.run([exe, "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True)
        if info.returncode != 0:
            raise CheckFailed(f"{exe}: no docker daemon answers ({info.stderr.strip()[:300]}); start dockerd")
        return exe
    raise CheckFailed("no docker client that builds with BuildKit (buildx plugin, or a client older than 23)")


def ensure_base(docker: str, rebuild: bool, mirror: str) -> None:
    """The stand-in for python:3.11-slim: debootstrapped bookworm, python on PATH as python/pip."""
    if not rebuild and subprocess.run([docker, "image", "inspect", BASE_TAG], capture_output=True).returncode == 0:
        log(f"base {BASE_TAG}: present")
        return
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        raise CheckFailed(f"making {BASE_TAG} needs root and debootstrap (apt-get install debootstrap)")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ds-base-") as tmp:
        root = Path(tmp) / "root"
        pkgs = "python3.11,python3-pip,python3-venv,ca-certificates"
        run(["debootstrap", "--variant=minbase", f"--include={pkgs}", "bookworm", str(root), mirror], timeout=1200)
        # like the python image: pip may install outside a venv; python/pip on PATH
        (root / "usr/lib/python3.11/EXTERNALLY-MANAGED").unlink(missing_ok=True)
        (root / "usr/local/bin/python").symlink_to("/usr/bin/python3")
        (root / "usr/local/bin/pip").symlink_to("/usr/bin/pip3")
        # trust what this machine trusts (an egress proxy may re-sign HTTPS with its own CA)
        local_cas = sorted(Path("/usr/local/share/ca-certificates").glob("*.crt"))
        for ca in local_cas:
            shutil.copy(ca, root / "usr/local/share/ca-certificates" / ca.name)
        if local_cas:
            run(["chroot", str(root), "update-ca-certificates"])
        run(["chroot", str(root), "apt-get", "clean"])
        shutil.rmtree(root / "var/lib/apt/lists", ignore_errors=True)
        for d in ("usr/share/doc", "usr/share/man", "usr/share/locale"):
            shutil.rmtree(root / d, ignore_errors=True)
        tar = subprocess.Popen(["tar", "-C", str(root), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
        changes = ["--change", "ENV LANG=C.UTF-8", "--change", 'CMD ["python3"]']
        run([docker, "import", *changes, "-", BASE_TAG], stdin=tar.stdout, timeout=600)
        if tar.wait() != 0:
            raise CheckFailed("tar of the debootstrapped root failed")
    log(f"base {BASE_TAG}: made in {time.monotonic() - t0:.0f} s")


# ------------------------------------------------------------------ torch from the host's local wheel


def local_torch_wheel(explicit: str | None) -> Path:
    """The CPU torch wheel pip resolves ``torch==2.13.0`` to on this machine; it must be a local file."""
    if explicit:
        path = Path(explicit)
    else:
        out = run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps"]
            + ["--quiet", "--report", "-", TORCH],
            timeout=300,
        )
        url = json.loads(out)["install"][0]["download_info"]["url"]
        if not url.startswith("file://"):
            raise CheckFailed(f"{TORCH} resolves to {url} here, not a local file; pass --torch-wheel PATH")
        path = Path(urllib.request.url2pathname(url[len("file://") :]))
    if not path.is_file() or "+cpu" not in path.name or "cp311" not in path.name:
        raise CheckFailed(f"{path}: expected a local CPU torch wheel for cp311 (torch-2.13.0+cpu-cp311-...whl)")
    return path


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        pass


@contextlib.contextmanager
def serve_wheel(wheel: Path) -> Iterator[str]:
    """A find-links page on 127.0.0.1 listing just ``wheel``."""
    with tempfile.TemporaryDirectory(prefix="ds-wheels-") as tmp:
        (Path(tmp) / wheel.name).symlink_to(wheel.resolve())
        handler = functools.partial(_QuietHandler, directory=tmp)
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}/"
        finally:
            server.shutdown()
            server.server_close()


# ------------------------------------------------------------------ build


def build(docker: str, builder: str, find_links: str, index_url: str, cache: bool, logdir: Path) -> float:
    """Build ``IMAGE:<builder>`` from the repository root; the seconds it took."""
    tag = f"{IMAGE}:{builder}"
    env = {**os.environ, "DOCKER_BUILDKIT": "1" if builder == "buildkit" else "0"}
    cmd = [docker, "build", "--network", "host", "-t", tag]
    for arg in (f"BASE={BASE_TAG}", f"TORCH_INDEX_URL={index_url}", f"PIP_FIND_LINKS={find_links}"):
        cmd += ["--build-arg", arg]
    cmd += ([] if cache else ["--no-cache"]) + (["--progress", "plain"] if builder == "buildkit" else [])
    logfile = logdir / f"build-{builder}.log"
    log(f"building {tag} ({'cached' if cache else 'no cache'}); log: {logfile}")
    t0 = time.monotonic()
    with logfile.open("w") as f:
        r = subprocess.run([*cmd, str(ROOT)], stdout=f, stderr=subprocess.STDOUT, env=env, timeout=3000)
    seconds = time.monotonic() - t0
    if r.returncode != 0:
        raise CheckFailed(f"{builder} build failed ({r.returncode}):\n{logfile.read_text()[-4000:]}")
    log(f"built {tag} in {seconds:.0f} s")
    return seconds


# ------------------------------------------------------------------ checks inside the image

PROBE = r"""
import importlib.metadata as md, json, os, pathlib
import torch, obstore, huggingface_hub, hf_xet, deltasync
from deltasync.storage import open_store
app = pathlib.Path.cwd()
junk = [str(p) for p in app.rglob("*") if p.name == "build" or p.name.endswith(".egg-info")]
print(json.dumps({
    "uid": os.getuid(), "cwd": str(app), "app_entries": sorted(os.listdir(app)), "junk": junk,
    "app_owner": app.stat().st_uid, "torch": torch.__version__, "cuda": torch.version.cuda,
    "deltasync": deltasync.__file__,
    "versions": {d: md.version(d) for d in ("obstore", "huggingface_hub", "hf-xet", "deltasync")},
    "s3": type(open_store("s3://bucket/prefix", endpoint="http://127.0.0.1:9", region="us-east-1")).__name__,
    "hf": type(open_store("hf://buckets/ns/bucket/prefix")).__name__,
}))
"""


def check_image(docker: str, tag: str) -> dict[str, Any]:
    """Config, contents and imports of ``tag``; its size in bytes."""
    (meta,) = json.loads(run([docker, "image", "inspect", tag]))
    config = meta["Config"]
    if config["User"] != "1000" or config["Cmd"] != CMD or "7860/tcp" not in (config.get("ExposedPorts") or {}):
        raise CheckFailed(f"{tag}: user {config['User']!r}, cmd {config['Cmd']}, ports {config.get('ExposedPorts')}")
    probe = json.loads(run([docker, "run", "--rm", "--network", "host", tag, "python", "-c", PROBE]).splitlines()[-1])
    problems = []
    if probe["uid"] != 1000 or probe["app_owner"] != 1000 or probe["cwd"] != APP_DIR:
        problems.append(f"runs as uid {probe['uid']} in {probe['cwd']} owned by {probe['app_owner']}")
    if probe["junk"]:
        problems.append(f"build leftovers in the app dir: {probe['junk']}")
    if not probe["torch"].endswith("+cpu") or probe["cuda"] is not None:
        problems.append(f"torch {probe['torch']} (cuda {probe['cuda']}) is not the CPU build")
    if (probe["s3"], probe["hf"]) != ("S3Store", "HFBucketStore"):
        problems.append(f"stores: {probe['s3']}, {probe['hf']}")
    if problems:
        raise CheckFailed(f"{tag}: " + "; ".join(problems))
    log(f"{tag}: uid 1000, app dir {probe['app_entries']}, torch {probe['torch']}, stores {probe['versions']}")
    return {"size_bytes": int(meta["Size"]), **probe}


# ------------------------------------------------------------------ the running demo


def moved(cmd: list[str], port: int) -> list[str]:
    """``cmd`` bound to 127.0.0.1:``port`` instead of 0.0.0.0:7860."""
    out = list(cmd)
    out[out.index("--host") + 1], out[out.index("--port") + 1] = "127.0.0.1", str(port)
    return out


@contextlib.contextmanager
def container(docker: str, tag: str, args: list[str], env: dict[str, str]) -> Iterator[str]:
    """A detached container on the host network; its name. On a failure inside, its log is attached."""
    name = f"ds-space-test-{os.getpid()}-{free_port()}"
    flags = [x for k, v in env.items() for x in ("-e", f"{k}={v}")]
    run([docker, "run", "-d", "--rm", "--network", "host", "--name", name, *flags, tag, *args])
    try:
        yield name
    except CheckFailed as exc:
        logs = subprocess.run([docker, "logs", "--tail", "40", name], capture_output=True, text=True)
        raise CheckFailed(f"{exc}\n--- {name} log:\n{logs.stdout}{logs.stderr}") from None
    finally:
        subprocess.run([docker, "stop", "-t", "10", name], capture_output=True, timeout=60)


def get(url: str, timeout: float = 10) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, b""


def wait_for(what: str, probe: Any, timeout: float) -> Any:
    """Poll ``probe()`` (bounded) until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.25)
    raise CheckFailed(f"{what}: not within {timeout:.0f} s")


def state_with_steps(base: str, n: int) -> Any:
    """A probe: the page's JSON state once it shows ``n`` commits and an applied step >= n - 1."""

    def probe() -> Any:
        status, body = get(base + "/api/state")
        if status != 200:
            return None
        state = json.loads(body)
        applied = state.get("applied") or {}
        if len(state.get("commits") or []) >= n and int(applied.get("step", -1)) >= n - 1:
            return state
        if state.get("error"):
            raise CheckFailed(f"the page reports an error: {state['error']}")
        return None

    return probe


def first_event(url: str) -> dict[str, Any]:
    """The first ``data:`` event of the page's SSE stream."""
    with urllib.request.urlopen(url, timeout=30) as r:
        for _ in range(100):
            line = r.readline().decode()
            if line.startswith("data: "):
                return dict(json.loads(line[len("data: ") :]))
    raise CheckFailed(f"{url}: no data event in the first 100 lines")


def check_demo(docker: str, tag: str, steps: int) -> dict[str, Any]:
    """The image's own CMD on a free port: page, state, SSE, steps; seconds to the first page."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    with container(docker, tag, moved(CMD, port), {}) as name:
        wait_for(f"{tag}: GET {base}/", lambda: get(base + "/")[0] == 200, 180)
        first_page = time.monotonic() - t0
        html = get(base + "/")[1].decode()
        if "deltasync" not in html or get(base + "/static/app.js")[0] != 200:
            raise CheckFailed(f"{tag}: the page or its script is missing")
        state = wait_for(f"{tag}: {steps} demo steps applied", state_with_steps(base, steps), 300)
        event = first_event(base + "/api/events")
        if event.get("type") != "snapshot" or "commits" not in (event.get("data") or {}):
            raise CheckFailed(f"{tag}: the SSE stream did not start with a snapshot: {str(event)[:300]}")
        owner = run([docker, "exec", name, "stat", "-c", "%u", f"{APP_DIR}/deltasync-demo"]).strip()
        if owner != "1000":
            raise CheckFailed(f"{tag}: ./deltasync-demo is owned by uid {owner}")
    applied = int(state["applied"]["step"])
    log(f"{tag}: first page after {first_page:.1f} s; {len(state['commits'])} commits, step {applied} applied")
    return {"first_page_s": round(first_page, 1), "commits_seen": len(state["commits"]), "applied_step": applied}


#: the terminal's end-of-run line about the signal path (spaces_demo/summary.py, signal_path_line)
SIGNAL_PATH = re.compile(
    r"^new steps via the signal server: (\d+), via store polling: (\d+); "
    r"the trainer's signals: (\d+) sent, (\d+) refused, (\d+) failed$",
    re.MULTILINE,
)
LOOP_ARGS = ["--model", "tiny", "--steps", "12", "--step-interval", "0.05"]


def check_loop_runs(base: str, logs: Any, runs: int = 2, steps: int = 12) -> dict[str, Any]:
    """Over ``runs`` loop runs of the demo at ``base`` (``logs()``: its output so far): every commit
    signal accepted and steps announced by the signal server to the follower, in each run."""
    wait_for(f"{base}: {runs} runs ended", lambda: len(SIGNAL_PATH.findall(logs())) >= runs, 300)
    out = logs()
    lines = SIGNAL_PATH.findall(out)[:runs]
    via_signal = []
    for i, (signal, polled, sent, refused, failed) in enumerate(lines):
        if int(refused) or int(failed) or not int(sent):
            raise CheckFailed(f"run {i}: the trainer's signals: {sent} sent, {refused} refused, {failed} failed")
        if not int(signal):
            raise CheckFailed(f"run {i}: no step reached the follower via the signal server ({polled} by polling)")
        status, body = get(f"{base}/signal/v1/runs/demo-{i}/head")
        head = json.loads(body) if status == 200 else {}
        if head.get("step") != steps:
            raise CheckFailed(f"run {i}: the signal server's head of demo-{i} is {status} {body[:200]!r}")
        via_signal.append(int(signal))
    if "signal for step" in out:  # the uploader's "signal for step N refused/not delivered" warnings
        raise CheckFailed("a commit signal was refused or lost: " + out[out.index("signal for step") :][:300])
    return {"loop_runs": len(lines), "loop_steps_via_signal": via_signal}


def check_demo_loop(docker: str, tag: str) -> dict[str, Any]:
    """The image's CMD with the loop on and a short run: the signal path holds in each of two runs."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with container(docker, tag, [*moved(CMD, port), *LOOP_ARGS], {"DELTASYNC_DEMO_LOOP": "2"}) as name:

        def logs() -> str:
            r = subprocess.run([docker, "logs", name], capture_output=True, text=True, timeout=60)
            return r.stdout + r.stderr

        figures = check_loop_runs(base, logs)
    log(f"{tag}: {figures['loop_runs']} loop runs, steps via the signal server: {figures['loop_steps_via_signal']}")
    return figures


def check_follow_s3(docker: str, tag: str, steps: int) -> dict[str, Any]:
    """One container trains into s3:// (SeaweedFS on 127.0.0.1), a second follows it via DELTASYNC_DEMO_FOLLOW."""
    sys.path.insert(0, str(ROOT))
    try:
        from deltasync.testing.seaweedfs import SeaweedFS
    except ImportError as exc:
        raise CheckFailed(f"the s3 follower check needs the test extra in this interpreter ({exc})") from None
    url = "s3://space/demo"
    with tempfile.TemporaryDirectory(prefix="ds-weed-") as tmp, SeaweedFS(Path(tmp), buckets=["space"]) as weed:
        env = {**weed.env, "DELTASYNC_DEMO_LOOP": "0"}
        trainer = ["deltasync", "demo", "--host", "127.0.0.1", "--port", str(free_port()), "--store", url]
        with container(docker, tag, trainer, env):
            port = free_port()
            base = f"http://127.0.0.1:{port}"
            with container(docker, tag, moved(CMD, port), {**env, "DELTASYNC_DEMO_FOLLOW": url}):
                state = wait_for(f"{tag}: follower at {steps} steps", state_with_steps(base, steps), 300)
    log(f"{tag}: follower over {url} applied step {state['applied']['step']}")
    return {"follow_s3_applied_step": int(state["applied"]["step"])}


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--builders", default="buildkit,classic", help="comma-separated: buildkit, classic")
    p.add_argument("--cache", action="store_true", help="let the builders reuse their cache (default: --no-cache)")
    p.add_argument("--keep", action="store_true", help=f"keep the built {IMAGE}:<builder> images")
    p.add_argument("--rebuild-base", action="store_true", help=f"debootstrap {BASE_TAG} again")
    p.add_argument("--mirror", default="http://deb.debian.org/debian", help="Debian mirror for debootstrap")
    p.add_argument("--torch-wheel", help="the CPU torch 2.13.0 cp311 wheel (default: what pip resolves here)")
    p.add_argument("--index-url", default=os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple")
    p.add_argument("--steps", type=int, default=4, help="demo steps to see applied (default 4)")
    p.add_argument("--skip-follow", action="store_true", help="skip the s3:// follower check")
    p.add_argument("--report", type=Path, help="write the figures here as JSON")
    args = p.parse_args(argv)
    builders = [b for b in args.builders.split(",") if b]
    if not builders or set(builders) - {"buildkit", "classic"}:
        p.error("--builders takes buildkit and/or classic")
    figures: dict[str, Any] = {}
    try:
        docker = docker_client()
        ensure_base(docker, args.rebuild_base, args.mirror)
        wheel = local_torch_wheel(args.torch_wheel)
        logdir = Path(tempfile.mkdtemp(prefix="ds-space-image-"))
        for builder in builders:
            with serve_wheel(wheel) as find_links:
                seconds = build(docker, builder, find_links, args.index_url, args.cache, logdir)
            tag = f"{IMAGE}:{builder}"
            try:
                info = check_image(docker, tag)
                figures[builder] = {"build_s": round(seconds), "size_mb": round(info["size_bytes"] / 1e6)}
                figures[builder].update(check_demo(docker, tag, args.steps))
                figures[builder].update(check_demo_loop(docker, tag))
                if not args.skip_follow and builder == builders[0]:
                    figures[builder].update(check_follow_s3(docker, tag, args.steps))
            finally:
                if not args.keep:
                    subprocess.run([docker, "rmi", tag], capture_output=True)
    except CheckFailed as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    log("figures: " + json.dumps(figures))
    if args.report:
        args.report.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
