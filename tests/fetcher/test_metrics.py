"""Prometheus metrics: the exposition format, staleness (injected clock), the /metrics endpoint, and
``deltasync follow --metrics-port`` as a user runs it."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import deltasync as ds
from deltasync.fetcher import SyncStats
from deltasync.fetcher.metrics import CONTENT_TYPE, MAX_PENDING, SyncMetrics

torch = pytest.importorskip("torch")

HTTP_TIMEOUT = 10.0

try:  # the real parser when it is installed; the strict one below runs either way
    from prometheus_client.parser import text_string_to_metric_families
except ImportError:  # pragma: no cover - depends on the environment
    text_string_to_metric_families = None

Series = dict[tuple[str, frozenset[tuple[str, str]]], float]

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"'
_SAMPLE = re.compile(rf"({_NAME})(?:\{{((?:{_LABEL})(?:,{_LABEL})*)?\}})? (\S+)")
_SUFFIXES = {
    "gauge": ("",),
    "counter": ("",),
    "summary": ("_sum", "_count"),
    "histogram": ("_bucket", "_sum", "_count"),
}


def _unescape(v: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], v)


def parse(text: str) -> tuple[Series, dict[str, str]]:
    """A strict reading of the text exposition format 0.0.4 as :class:`SyncMetrics` writes it: every
    family has HELP then TYPE before its samples, every sample belongs to the family above it, no
    series repeats, labels are well quoted, values are floats, histogram buckets are cumulative."""
    assert text.endswith("\n") and "\r" not in text
    series: Series = {}
    types: dict[str, str] = {}
    family: str | None = None
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("# HELP "):
            name, _, doc = line[7:].partition(" ")
            assert re.fullmatch(_NAME, name) and doc and name not in types, line
            m = re.fullmatch(rf"# TYPE ({_NAME}) (gauge|counter|summary|histogram)", lines[i + 1])
            assert m and m[1] == name, lines[i + 1]
            family, types[name] = name, m[2]
            i += 2
            continue
        assert not line.startswith("#") and family is not None, line
        m = _SAMPLE.fullmatch(line)
        assert m, f"malformed sample line {line!r}"
        name, body, raw = m[1], m[2] or "", m[7]
        assert name in {family + s for s in _SUFFIXES[types[family]]}, f"{name} outside its family {family}"
        labels = [(k, _unescape(v)) for k, v in re.findall(_LABEL, body)]
        assert len({k for k, _ in labels}) == len(labels), line
        value = float(raw.replace("Inf", "inf"))
        key = (name, frozenset(labels))
        assert key not in series, f"repeated series {line!r}"
        series[key] = value
        i += 1
    for name, kind in types.items():
        if kind == "histogram":
            buckets = sorted(
                ((dict(k[1]), v) for k, v in series.items() if k[0] == name + "_bucket"),
                key=lambda b: float(b[0]["le"].replace("Inf", "inf")),
            )
            counts = [v for _, v in buckets]
            assert counts == sorted(counts) and buckets[-1][0]["le"] == "+Inf"
            others = frozenset((k, v) for k, v in buckets[-1][0].items() if k != "le")
            assert series[(name + "_count", others)] == counts[-1]
    if text_string_to_metric_families is not None:
        parsed = {f.name for f in text_string_to_metric_families(text)}
        assert {n.removesuffix("_total") for n in types} == parsed
    return series, types


def value(series: Series, name: str, **labels: str) -> float:
    return series[(name, frozenset(labels.items()))]


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# ------------------------------------------------------------ format


def test_the_exposition_parses_with_help_and_type_for_every_family() -> None:
    clock = Clock()
    m = SyncMetrics({"rank": "0", "run": 'grpo "7"\\\n'}, clock=clock)
    empty, types = parse(m.render())
    const = {"rank": "0", "run": 'grpo "7"\\\n'}
    assert value(empty, "deltasync_staleness_seconds", **const) == 0.0
    assert value(empty, "deltasync_syncs_total", **const) == 0
    assert not any(k[0] in ("deltasync_applied_step", "deltasync_staleness_steps") for k in empty)
    assert types["deltasync_sync_duration_seconds"] == "histogram"
    assert types["deltasync_sync_failures_total"] == "counter"
    assert types["deltasync_sync_phase_seconds"] == "summary"
    assert 'run="grpo \\"7\\"\\\\\\n"' in m.render()  # quote, backslash and newline escaped

    m.observe_head(12, committed_at=990.0)
    m.observe_sync(
        SyncStats(
            10, base_step=8, steps=2, nbytes=4096, download_s=0.5, decode_s=0.1, verify_s=0.2, apply_s=0.3, total_s=1.25
        ),
        pause_s=0.04,
    )
    m.observe_sync(SyncStats(12, base_step=10, steps=2, nbytes=1024, download_s=0.25, total_s=0.5))
    m.observe_failure("apply")
    m.observe_failure("apply")
    m.observe_failure('weird "kind"')
    m.observe_pause(3.0)
    s, _ = parse(m.render())
    assert value(s, "deltasync_applied_step", **const) == 12
    assert value(s, "deltasync_head_step", **const) == 12
    assert value(s, "deltasync_syncs_total", **const) == 2
    assert value(s, "deltasync_applied_steps_total", **const) == 4
    assert value(s, "deltasync_downloaded_bytes_total", **const) == 5120
    assert value(s, "deltasync_last_sync_bytes", **const) == 1024
    assert value(s, "deltasync_sync_failures_total", kind="apply", **const) == 2
    assert value(s, "deltasync_sync_failures_total", kind='weird "kind"', **const) == 1
    assert value(s, "deltasync_sync_phase_seconds_sum", phase="download", **const) == 0.75
    assert value(s, "deltasync_sync_phase_seconds_sum", phase="verify", **const) == 0.2
    assert value(s, "deltasync_sync_phase_seconds_count", phase="apply", **const) == 2
    assert value(s, "deltasync_last_sync_phase_seconds", phase="download", **const) == 0.25
    assert value(s, "deltasync_last_sync_phase_seconds", phase="total", **const) == 0.5
    assert value(s, "deltasync_sync_duration_seconds_count", **const) == 2
    assert value(s, "deltasync_sync_duration_seconds_sum", **const) == 1.75
    assert value(s, "deltasync_sync_duration_seconds_bucket", le="1.0", **const) == 1
    assert value(s, "deltasync_sync_duration_seconds_bucket", le="2.5", **const) == 2
    assert value(s, "deltasync_pause_seconds_count", **const) == 2
    assert value(s, "deltasync_pause_seconds_sum", **const) == 3.04
    assert value(s, "deltasync_pause_seconds_bucket", le="0.05", **const) == 1
    assert value(s, "deltasync_last_pause_seconds", **const) == 3.0
    assert value(s, "deltasync_head_commit_timestamp_seconds", **const) == 990.0
    assert value(s, "deltasync_last_sync_timestamp_seconds", **const) == 1000.0


def test_constant_label_names_are_checked() -> None:
    for bad in ("0rank", "__x", "le", "kind", "phase", "a-b"):
        with pytest.raises(ValueError, match="label name"):
            SyncMetrics({bad: "x"})


def test_without_constant_labels_samples_have_no_braces() -> None:
    s = SyncMetrics(clock=Clock()).render()
    assert "\ndeltasync_syncs_total 0\n" in s
    assert '\ndeltasync_sync_duration_seconds_bucket{le="+Inf"} 0\n' in s
    parse(s)


# ------------------------------------------------------------ staleness


def test_staleness_in_steps_and_seconds_with_an_injected_clock() -> None:
    clock = Clock(1000.0)
    m = SyncMetrics(clock=clock)
    assert m.staleness() == (None, 0.0)
    m.observe_head(5)  # first seen now, no signal time
    clock.t = 1004.0
    assert m.staleness() == (None, 4.0)  # nothing applied yet: behind since step 5 was seen
    m.observe_applied(5)  # the step the target was found at
    assert m.staleness() == (0, 0.0)
    assert m.head_step == 5 and m.applied_step == 5

    m.observe_head(6, committed_at=1010.0)
    m.observe_head(8, committed_at=1020.0)
    m.observe_head(7, committed_at=1015.0)  # late news of an older step: head stays at 8
    m.observe_head(8)  # the store shows 8 later: the signal's earlier time stands
    clock.t = 1030.0
    assert m.staleness() == (3, 20.0)  # behind since step 6 was committed
    parsed, _ = parse(m.render())
    assert value(parsed, "deltasync_staleness_steps") == 3
    assert value(parsed, "deltasync_staleness_seconds") == 20.0
    assert value(parsed, "deltasync_head_step") == 8

    m.observe_sync(SyncStats(6, steps=1, total_s=0.1))
    assert m.staleness() == (2, 15.0)  # step 7 is the oldest one not held
    m.observe_applied(7, seconds=0.2)
    assert m.staleness() == (1, 10.0)
    clock.t = 1031.0
    assert m.staleness() == (1, 11.0)  # the gauge grows while nothing is applied
    m.observe_sync(SyncStats(8, steps=1, total_s=0.1))
    assert m.staleness() == (0, 0.0)
    m.observe_head(8, committed_at=900.0)  # a step already held never makes it stale
    m.observe_head(3)
    assert m.staleness() == (0, 0.0) and m.head_step == 8

    m.observe_head(9, committed_at=5000.0)  # the trainer's clock runs ahead of ours: never negative
    assert m.staleness() == (1, 0.0)
    m.observe_head(10, committed_at=0.0)  # a signal without a time: first seen now
    m.observe_sync(SyncStats(9, steps=1))
    clock.t = 1041.0
    assert m.staleness() == (1, 10.0)
    m.observe_sync(SyncStats(12, steps=3))  # a step past any head seen is committed too
    assert m.staleness() == (0, 0.0) and m.head_step == 12
    m.observe_head(13)  # the store shows 13 first ...
    m.observe_head(13, committed_at=1035.0)  # ... then its signal arrives, with the commit time
    assert m.staleness() == (1, 6.0)


def test_many_pending_steps_are_bounded_and_never_under_report() -> None:
    clock = Clock(0.0)
    m = SyncMetrics(clock=clock)
    m.observe_applied(0)
    for step in range(1, 3 * MAX_PENDING):
        m.observe_head(step, committed_at=float(step))
    assert m.pending_commits == MAX_PENDING
    clock.t = 10_000.0
    assert m.staleness() == (3 * MAX_PENDING - 1, 9999.0)
    m.observe_applied(2 * MAX_PENDING, seconds=1.0)
    steps, seconds = m.staleness()
    assert steps == MAX_PENDING - 1
    assert seconds >= 10_000.0 - (2 * MAX_PENDING + 1)


def test_observations_from_many_threads_add_up() -> None:
    m = SyncMetrics(clock=Clock())
    n = 500

    def work(k: int) -> None:
        for i in range(n):
            m.observe_head(k * n + i)
            m.observe_sync(SyncStats(k * n + i, steps=1, nbytes=2, total_s=0.001))
            m.observe_failure("apply")
            m.observe_pause(0.01)
            m.render()

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    s, _ = parse(m.render())
    assert value(s, "deltasync_syncs_total") == 4 * n
    assert value(s, "deltasync_downloaded_bytes_total") == 8 * n
    assert value(s, "deltasync_sync_failures_total", kind="apply") == 4 * n
    assert value(s, "deltasync_pause_seconds_count") == 4 * n
    assert value(s, "deltasync_head_step") == 4 * n - 1


# ------------------------------------------------------------ endpoint


def _get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.headers["Content-Type"], e.read().decode()


def test_the_endpoint_serves_metrics_on_a_free_port() -> None:
    m = SyncMetrics({"rank": "3"}, clock=Clock())
    m.observe_sync(SyncStats(4, steps=1, nbytes=10))
    with m.serve(0) as server:
        assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}/metrics"
        status, ctype, body = _get(server.url)
        assert (status, ctype) == (200, CONTENT_TYPE)
        assert body == m.render()
        assert value(parse(body)[0], "deltasync_applied_step", rank="3") == 4
        status, _, body = _get(server.url + "?name[]=x")
        assert status == 200 and "deltasync_applied_step" in body
        for path in ("/", "/metricsx", "/favicon.ico"):
            status, _, body = _get(f"http://127.0.0.1:{server.port}{path}")
            assert status == 404 and "/metrics" in body
        m.observe_sync(SyncStats(5, steps=1, nbytes=10))
        assert value(parse(_get(server.url)[2])[0], "deltasync_applied_step", rank="3") == 5  # live
    with pytest.raises(urllib.error.URLError):
        _get(server.url)  # closed: the port is released


# ------------------------------------------------------------ follow


def _states(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    state = {"w": torch.randn(64, 64, generator=g).to(torch.bfloat16), "b": torch.randn(64, generator=g)}
    out = [state]
    for i in range(1, n):
        state = {k: v.clone() for k, v in state.items()}
        state["w"].view(-1)[i * 11 : i * 11 + 7] += 1
        out.append(state)
    return out


def test_follow_records_head_syncs_and_bytes_of_a_tensor_target() -> None:
    store = ds.open_store("memory://metrics-follow")
    with ds.DeltaUploader(store, anchor_every=100, on_backlog="block") as up:
        for step, state in enumerate(_states(4), start=1):
            up.push(state, step=step).result()
    clock = Clock(2000.0)
    m = SyncMetrics(clock=clock)
    target = {k: torch.zeros_like(v) for k, v in _states(1)[0].items()}
    fetcher = ds.DeltaFetcher(store)
    assert fetcher.follow(target, until_step=4, poll_interval=0.01, metrics=m) == 4
    assert m.staleness() == (0, 0.0)
    s, _ = parse(m.render())
    assert value(s, "deltasync_applied_step") == 4 and value(s, "deltasync_head_step") == 4
    assert value(s, "deltasync_syncs_total") == 1  # the store showed step 4 at once
    assert value(s, "deltasync_applied_steps_total") == 4  # the anchor and three patches
    assert fetcher.last_stats is not None
    assert value(s, "deltasync_downloaded_bytes_total") == fetcher.last_stats.nbytes > 0
    assert value(s, "deltasync_sync_phase_seconds_count", phase="verify") == 1

    with ds.DeltaUploader(store, anchor_every=100, on_backlog="block") as up:
        up.push(_states(5)[-1], step=5).result()
    assert fetcher.follow(target, until_step=5, poll_interval=0.01, metrics=m) == 5
    s, _ = parse(m.render())
    assert value(s, "deltasync_syncs_total") == 2 and value(s, "deltasync_applied_step") == 5
    assert value(s, "deltasync_last_sync_bytes") == fetcher.last_stats.nbytes


def test_follow_into_a_dir_records_steps_and_seconds(tmp_path: Path) -> None:
    store = ds.open_store(tmp_path / "run")
    with ds.DeltaUploader(store, anchor_every=100, on_backlog="block") as up:
        up.push(_states(1)[0], step=3).result()
    m = SyncMetrics(clock=Clock())
    assert ds.DeltaFetcher(store).follow(tmp_path / "out", until_step=3, poll_interval=0.01, metrics=m) == 3
    s, _ = parse(m.render())
    assert value(s, "deltasync_applied_step") == 3 and value(s, "deltasync_staleness_steps") == 0
    assert value(s, "deltasync_syncs_total") == 1 and value(s, "deltasync_sync_duration_seconds_count") == 1
    assert value(s, "deltasync_sync_phase_seconds_count", phase="download") == 0  # no stats from materialize
    # a second follower finds the dir at step 3: applied at once, nothing synced
    m2 = SyncMetrics(clock=Clock())
    assert ds.DeltaFetcher(store).follow(tmp_path / "out", until_step=3, poll_interval=0.01, metrics=m2) == 3
    s2, _ = parse(m2.render())
    assert value(s2, "deltasync_applied_step") == 3 and value(s2, "deltasync_syncs_total") == 0


def test_follow_cli_serves_metrics_while_it_follows(tmp_path: Path) -> None:
    from cli_process import _finish, _lines, _script, read_until

    (tmp_path / "run").mkdir()
    proc = subprocess.Popen(
        [*_script("deltasync"), "follow", "--store", "run", "--out", "out", "--poll-interval", "0.05"]
        + ["--metrics-port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        cwd=tmp_path,
    )
    try:
        out, err = _lines(proc, proc.stdout), _lines(proc, proc.stderr)
        line = read_until(err, "metrics at ", proc)
        url = line.strip().removeprefix("metrics at ")
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", url), line
        s, _ = parse(_get(url)[2])
        assert value(s, "deltasync_syncs_total") == 0 and value(s, "deltasync_staleness_seconds") == 0
        states = _states(3)
        with ds.DeltaUploader(ds.open_store(tmp_path / "run"), anchor_every=100, on_backlog="block") as up:
            for step, state in enumerate(states, start=1):
                up.push(state, step=step).result()
        read_until(out, "step 3 -> out", proc)
        s, _ = parse(_get(url)[2])
        assert value(s, "deltasync_applied_step") == 3
        assert value(s, "deltasync_head_step") == 3
        assert value(s, "deltasync_staleness_steps") == 0
        assert value(s, "deltasync_staleness_seconds") == 0
        assert 1 <= value(s, "deltasync_syncs_total") <= 3
        assert value(s, "deltasync_sync_duration_seconds_count") == value(s, "deltasync_syncs_total")
        assert not math.isnan(value(s, "deltasync_last_sync_timestamp_seconds"))
        assert proc.poll() is None
    finally:
        _finish(proc)


def test_metrics_import_neither_torch_nor_the_server() -> None:
    code = (
        "import sys, deltasync.fetcher.metrics\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'fastapi', 'starlette', 'uvicorn', 'prometheus_client')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
