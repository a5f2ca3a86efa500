"""Hostile input to the signal server: every request gets a 4xx (never a 5xx) and the server keeps serving.

Covers bodies Python's json accepts but JSON does not (NaN, Infinity, duplicate keys, lone
surrogates, numbers that overflow), numbers that only Python calls digits ("²", "１２"),
integers past every range, and the same through a real uvicorn on 127.0.0.1.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlencode

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_harness import ThreadServer, raw_status

from deltasync.protocol.keys import MAX_STEP
from deltasync.server import Settings, create_app
from deltasync.server._input import strict_json_loads

PUB = "publish-token-0123"
SUB = "subscribe-token-0123"
D1, D2 = "1" * 32, "2" * 32
JSON = {"Content-Type": "application/json"}


def auth(tok: str = PUB) -> dict[str, str]:
    return {"Authorization": f"Bearer {tok}"}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    # one app for the whole module: whatever a test sends, the next ones must still be served
    db = tmp_path_factory.mktemp("hostile") / "s.db"
    # a large body limit, so that deep nesting and 5000-digit numbers reach the JSON parser (413 has its own tests)
    s = Settings(publish_token=PUB, subscribe_token=SUB, db_path=str(db), max_wait_s=0.05, max_body_bytes=1 << 20)
    app = create_app(s)
    with TestClient(app) as c:  # raise_server_exceptions: an unhandled error fails the test with its traceback
        assert c.post("/v1/runs/r/commits", json={"step": 5, "manifest_digest": D1}, headers=auth()).status_code == 201
        yield c


def still_serving(c: TestClient) -> None:
    """The app answers and its state is intact after a hostile request."""
    assert c.get("/healthz").status_code == 200
    r = c.get("/v1/runs/r/head", headers=auth(SUB))
    assert r.status_code == 200 and r.json()["step"] == 5 and r.json()["manifest_digest"] == D1
    assert c.post("/v1/runs/r/commits", json={"step": 5, "manifest_digest": D1}, headers=auth()).status_code == 200


def assert_422(r: Any) -> list[dict[str, Any]]:
    """A 422 in FastAPI's validation-error shape: ``{"detail": [{"type", "loc", "msg", ...}]}``."""
    assert r.status_code == 422, (r.status_code, r.text[:300])
    detail = r.json()["detail"]
    assert isinstance(detail, list) and detail and {"type", "loc", "msg"} <= set(detail[0])
    return detail


# ------------------------------------------------------------- JSON bodies

COMMIT_BODIES = {
    "nan step": b'{"step": NaN, "manifest_digest": "%s"}' % D1.encode(),
    "infinity step": b'{"step": Infinity, "manifest_digest": "%s"}' % D1.encode(),
    "-infinity step": b'{"step": -Infinity, "manifest_digest": "%s"}' % D1.encode(),
    "nan elsewhere": b'{"step": 6, "manifest_digest": "%s", "run_id": NaN}' % D1.encode(),
    "overflowing float": b'{"step": 1e400, "manifest_digest": "%s"}' % D1.encode(),
    "overflowing negative float": b'{"step": -1e400, "manifest_digest": "%s"}' % D1.encode(),
    "lone surrogate in a value": b'{"step": 6, "manifest_digest": "%s", "run_id": "\\ud800"}' % D1.encode(),
    "lone low surrogate": b'{"step": 6, "manifest_digest": "\\udc00"}',
    "lone surrogate in a key": b'{"step": 6, "manifest_digest": "%s", "\\ud800": 1}' % D1.encode(),
    "surrogate as raw bytes": b'{"step": 6, "manifest_digest": "%s", "run_id": "\xed\xa0\x80"}' % D1.encode(),
    "duplicate key": b'{"step": 6, "step": 7, "manifest_digest": "%s"}' % D1.encode(),
    "duplicate key, same value": b'{"step": 6, "manifest_digest": "%s", "step": 6}' % D1.encode(),
    "duplicate nested key": b'{"step": 6, "manifest_digest": "%s", "kind": {"a": 1, "a": 2}}' % D1.encode(),
    "int past 2**63": b'{"step": 9223372036854775808, "manifest_digest": "%s"}' % D1.encode(),
    "int past MAX_STEP": b'{"step": %d, "manifest_digest": "%s"}' % (MAX_STEP + 1, D1.encode()),
    "huge int": b'{"step": 1%s, "manifest_digest": "%s"}' % (b"0" * 5000, D1.encode()),
    "huge float that is integral": b'{"step": 1e300, "manifest_digest": "%s"}' % D1.encode(),
    "negative step": b'{"step": -1, "manifest_digest": "%s"}' % D1.encode(),
    "negative zero float": b'{"step": -0.5, "manifest_digest": "%s"}' % D1.encode(),
    "step as a string": b'{"step": "6", "manifest_digest": "%s"}' % D1.encode(),
    "step as fullwidth digits": '{"step": "１２", "manifest_digest": "%s"}'.encode() % D1.encode(),
    "step true": b'{"step": true, "manifest_digest": "%s"}' % D1.encode(),
    "deep nesting": b"[" * 10000 + b"]" * 10000,
    "not UTF-8": b'{"step": 6, "manifest_digest": "\xff\xfe"}',
    "UTF-16": '{"step": 6}'.encode("utf-16"),
    "BOM": b'\xef\xbb\xbf{"step": 6, "manifest_digest": "%s"}' % D1.encode(),
    "empty": b"",
    "whitespace": b"   ",
    "null": b"null",
    "a list": b"[1, 2]",
    "truncated": b'{"step": 6, "manifest_dig',
    "trailing garbage": b'{"step": 6, "manifest_digest": "%s"} x' % D1.encode(),
    "NUL byte": b'{"step": 6, "manifest_digest": "%s\x00"}' % D1.encode(),
}


@pytest.mark.parametrize("body", COMMIT_BODIES.values(), ids=COMMIT_BODIES.keys())
@pytest.mark.parametrize("content_type", ["application/json", None, "text/plain"])
def test_hostile_commit_bodies_are_422(client: TestClient, body: bytes, content_type: str | None) -> None:
    headers = auth() if content_type is None else {**auth(), "Content-Type": content_type}
    assert_422(client.post("/v1/runs/r/commits", content=body, headers=headers))
    still_serving(client)


def test_refusals_say_why(client: TestClient) -> None:
    why = {
        "duplicate key": "duplicate key 'step'",
        "nan step": "NaN",
        "lone surrogate in a value": "surrogate",
        "overflowing float": "out of range",
        "not UTF-8": "not UTF-8",
    }
    for name, words in why.items():
        detail = assert_422(client.post("/v1/runs/r/commits", content=COMMIT_BODIES[name], headers={**auth(), **JSON}))
        assert detail[0]["type"] == "json_invalid" and words in detail[0]["ctx"]["error"], (name, detail)


WEBHOOK_BODIES = {
    "nan secret": b'{"url": "http://127.0.0.1:9/h", "secret": NaN}',
    "infinity secret": b'{"url": "http://127.0.0.1:9/h", "secret": Infinity}',
    "surrogate secret": b'{"url": "http://127.0.0.1:9/h", "secret": "\\ud800aaaaaaaaaaaaaaaaaaaa"}',
    "surrogate url": b'{"url": "http://127.0.0.1:9/\\udfff", "secret": "aaaaaaaaaaaaaaaaaaaa"}',
    "duplicate url": b'{"url": "http://127.0.0.1:9/h", "url": "http://evil/", "secret": "aaaaaaaaaaaaaaaaaaaa"}',
    "secret as a number": b'{"url": "http://127.0.0.1:9/h", "secret": 12345678901234567890123}',
    "port past 65535": b'{"url": "http://127.0.0.1:99999/h", "secret": "aaaaaaaaaaaaaaaaaaaa"}',
    "port zero": b'{"url": "http://127.0.0.1:0/h", "secret": "aaaaaaaaaaaaaaaaaaaa"}',
    "non-ASCII host": '{"url": "http://ünï.example/h", "secret": "aaaaaaaaaaaaaaaaaaaa"}'.encode(),
}


@pytest.mark.parametrize("body", WEBHOOK_BODIES.values(), ids=WEBHOOK_BODIES.keys())
def test_hostile_webhook_bodies_are_422(client: TestClient, body: bytes) -> None:
    assert_422(client.post("/v1/runs/r/webhooks", content=body, headers={**auth(), **JSON}))
    assert client.get("/v1/runs/r/webhooks", headers=auth()).json() == []  # nothing was registered
    still_serving(client)


def test_valid_unicode_still_passes(client: TestClient) -> None:
    # a surrogate *pair* is a valid escape (one astral character); non-ASCII secrets are fine
    body = '{"url": "http://127.0.0.1:9/h", "secret": "\\ud83d\\ude00-geheimnis-äöü-123"}'.encode()
    r = client.post("/v1/runs/r/webhooks", content=body, headers={**auth(), **JSON})
    assert r.status_code == 201, r.text
    assert client.delete(f"/v1/runs/r/webhooks/{r.json()['id']}", headers=auth()).status_code == 204
    # 6.0 is an integer to JSON Schema; strict parsing does not change that
    r = client.post(
        "/v1/runs/r/commits",
        content=b'{"step": 5.0, "manifest_digest": "%s"}' % D1.encode(),
        headers={**auth(), **JSON},
    )
    assert r.status_code == 200


def test_strict_json_loads() -> None:
    assert strict_json_loads(b'{"a": [1, 2.5, "\\ud83d\\ude00", {"b": null}]}') == {"a": [1, 2.5, "😀", {"b": None}]}
    assert strict_json_loads(b"-9223372036854775808") == -(2**63)
    for bad in (
        b'{"a": 1, "a": 1}',
        b'[{"x": {"y": 1, "y": 2}}]',
        b"NaN",
        b"[-Infinity]",
        b"1e309",
        b'["\\ud800"]',
        b'{"\\udbff": 0}',
        b"1" * 20,
        b"\xed\xa0\x80",
        b"[" * 100_000,
    ):
        with pytest.raises(json.JSONDecodeError):
            strict_json_loads(bad)


# JSON-ish values as Python's json.dumps writes them: NaN / Infinity and lone surrogates included
_ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=12)  # surrogates (Cs) too
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.sampled_from([math.nan, math.inf, -math.inf, 2**63, -(2**63) - 1, MAX_STEP + 1, 10**30, 5.0, -0.0])
    | _ANY_TEXT
)
_VALUES = st.recursive(
    _SCALARS, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(_ANY_TEXT, kids, max_size=4), max_leaves=12
)
_BODIES = st.one_of(
    st.binary(max_size=300),
    _VALUES.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({"step": _SCALARS, "manifest_digest": _SCALARS | st.just(D2)}).map(
        lambda v: json.dumps(v).encode()
    ),
    st.fixed_dictionaries({"url": _SCALARS | st.just("http://127.0.0.1:9/h"), "secret": _SCALARS}).map(
        lambda v: json.dumps(v).encode()
    ),
)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=_BODIES, path=st.sampled_from(["/v1/runs/r/commits", "/v1/runs/r/webhooks"]))
def test_fuzzed_bodies_never_5xx(client: TestClient, body: bytes, path: str) -> None:
    r = client.post(path, content=body, headers={**auth(), **JSON})
    assert r.status_code < 500, (r.status_code, r.text[:300])
    strict_json_loads(r.content or b"null")  # the reply itself is strict JSON
    if r.status_code == 201 and path.endswith("/webhooks"):
        assert client.delete(f"{path}/{r.json()['id']}", headers=auth()).status_code == 204


# ------------------------------------------------------- Last-Event-ID and queries

BAD_EVENT_IDS = {
    "superscript two, latin-1": "²".encode("latin-1"),
    "superscript two, UTF-8": "²".encode(),
    "fullwidth digits": "１２".encode(),
    "arabic-indic digit": "٣".encode(),
    "negative": b"-1",
    "exponent": b"1e3",
    "float": b"1.0",
    "plus": b"+1",
    "hex": b"0x10",
    "underscore": b"1_0",
    "inner space": b"1 2",
    "past 2**63": b"9223372036854775808",
    "past MAX_STEP": str(MAX_STEP + 1).encode(),
    "twenty nines": b"9" * 20,
    "very long": b"1" * 5000,
    "letters": b"abc",
}


@pytest.mark.parametrize("value", BAD_EVENT_IDS.values(), ids=BAD_EVENT_IDS.keys())
def test_hostile_last_event_id_is_422(live: Live, value: bytes) -> None:
    # through uvicorn, reading only the status line: a wrongly accepted id would open an endless stream
    assert live.status(b"/v1/runs/r/events?limit=1", b"Last-Event-ID: " + value) == 422
    live.still_serving()


@pytest.mark.parametrize(("value", "first"), [(b"", 5), (b"   ", 5), (b"4", 5), (b" 4 ", 5), (b"0", 5)])
def test_good_last_event_ids(client: TestClient, value: bytes, first: int) -> None:
    # an empty Last-Event-ID is the SSE "no id": the stream starts at the head
    headers = [(b"Authorization", f"Bearer {SUB}".encode()), (b"Last-Event-ID", value)]
    r = client.get("/v1/runs/r/events", params={"limit": 1}, headers=headers)
    assert r.status_code == 200 and f"id: {first}\n" in r.text


BAD_NUMBERS = [
    "²",
    "１２",
    "٣",
    "1_0",
    "+1",
    " 1",
    "1 ",
    "0x1",
    "1e3",
    "1.5",
    "nan",
    "NaN",
    "inf",
    "-inf",
    "",
    "9" * 5000,
]


@pytest.mark.parametrize("value", BAD_NUMBERS)
@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("/v1/runs/r/wait", "after"),
        ("/v1/runs/r/commits", "after"),
        ("/v1/runs/r/commits", "limit"),
        ("/v1/runs/r/events", "after"),
        ("/v1/runs/r/events", "limit"),
    ],
)
def test_hostile_integer_query_parameters_are_422(
    client: TestClient, live: Live, path: str, name: str, value: str
) -> None:
    params = {name: value, **({"timeout": "0"} if path.endswith("/wait") else {})}
    if path.endswith("/events"):  # the status line only: a wrongly accepted value would open an endless stream
        assert live.status(f"{path}?{urlencode(params)}".encode()) == 422
    else:
        assert_422(client.get(path, params=params, headers=auth(SUB)))


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "Infinity", "１", "1_0", "0x1", "1e99999", "", "-1", "3601"])
def test_hostile_float_query_parameters_are_422(client: TestClient, live: Live, value: str) -> None:
    assert_422(client.get("/v1/runs/r/wait", params={"timeout": value}, headers=auth(SUB)))
    assert live.status(f"/v1/runs/r/events?{urlencode({'heartbeat': value, 'after': 5})}".encode()) == 422


@pytest.mark.parametrize("value", [str(-2), str(MAX_STEP + 1), str(2**63), str(2**64)])
def test_out_of_range_query_integers_are_422(client: TestClient, live: Live, value: str) -> None:
    assert_422(client.get("/v1/runs/r/wait", params={"after": value, "timeout": "0"}, headers=auth(SUB)))
    assert_422(client.get("/v1/runs/r/commits", params={"after": value}, headers=auth(SUB)))
    assert live.status(f"/v1/runs/r/events?after={value}".encode()) == 422


def test_ascii_numbers_still_parse(client: TestClient) -> None:
    assert client.get("/v1/runs/r/wait", params={"after": "4", "timeout": "0.01"}, headers=auth(SUB)).status_code == 200
    assert client.get("/v1/runs/r/wait", params={"after": "5", "timeout": "1e-2"}, headers=auth(SUB)).status_code == 204
    assert client.get("/v1/runs/r/wait", params={"after": "-1", "timeout": "0"}, headers=auth(SUB)).status_code == 200
    assert [c["step"] for c in client.get("/v1/runs/r/commits", params={"after": "-1"}, headers=auth(SUB)).json()] == [
        5
    ]


@pytest.mark.parametrize("length", [b"9" * 5000, b"-1", "１".encode(), b"1e3"])
def test_hostile_content_length_is_413(client: TestClient, length: bytes) -> None:
    headers = [(b"Authorization", f"Bearer {PUB}".encode()), (b"Content-Type", b"application/json")]
    r = client.post("/v1/runs/r/commits", content=b"{}", headers=[*headers, (b"Content-Length", length)])
    assert r.status_code == 413
    still_serving(client)


# ------------------------------------------------------ through a real uvicorn


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class Live:
    """A uvicorn on 127.0.0.1 serving the app, spoken to in raw HTTP/1.1 (any header bytes)."""

    def __init__(self, port: int, errors: _Errors) -> None:
        self.port = port
        self.errors = errors

    def status(self, target: bytes, *headers: bytes, method: bytes = b"GET", body: bytes | None = None) -> int:
        """The status code of one request (``target`` is path and query); only the status line is read."""
        lines = [method + b" " + target + b" HTTP/1.1", b"Host: 127.0.0.1", b"Authorization: Bearer " + PUB.encode()]
        lines += [b"Connection: close", *headers]
        if body is not None:
            lines += [b"Content-Type: application/json", b"Content-Length: %d" % len(body)]
        return raw_status(self.port, b"\r\n".join(lines) + b"\r\n\r\n" + (body or b""))

    def still_serving(self) -> None:
        """The server answers, logged no error, and still has its head."""
        assert self.status(b"/healthz") == 200
        assert self.status(b"/v1/runs/r/head") == 200
        assert [r.getMessage() for r in self.errors.records] == []


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    db = tmp_path_factory.mktemp("live") / "s.db"
    app = create_app(Settings(publish_token=PUB, subscribe_token=SUB, db_path=str(db), heartbeat_s=0.5))
    errors = _Errors()
    watched = [logging.getLogger(n) for n in ("uvicorn.error", "uvicorn", "deltasync.server", "")]
    with ThreadServer(app) as srv:
        for lg in watched:
            lg.addHandler(errors)
        try:
            srv_live = Live(srv.port, errors)
            good = b'{"step": 5, "manifest_digest": "%s"}' % D1.encode()
            assert srv_live.status(b"/v1/runs/r/commits", method=b"POST", body=good) == 201
            yield srv_live
        finally:
            for lg in watched:
                lg.removeHandler(errors)


@pytest.mark.parametrize(
    "name", ["nan step", "lone surrogate in a value", "duplicate key", "surrogate as raw bytes", "huge int"]
)
def test_live_server_refuses_hostile_bodies(live: Live, name: str) -> None:
    assert live.status(b"/v1/runs/r/commits", method=b"POST", body=COMMIT_BODIES[name]) in (413, 422)
    live.still_serving()


def test_live_server_refuses_non_ascii_query_digits(live: Live) -> None:
    assert live.status(b"/v1/runs/r/wait?after=%C2%B2&timeout=0") == 422
    assert live.status(b"/v1/runs/r/wait?after=\xc2\xb2&timeout=0") in (400, 422)  # raw bytes in the request line
    live.still_serving()
