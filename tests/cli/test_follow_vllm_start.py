"""``deltasync follow --vllm`` started right after ``vllm serve ... &`` (the quickstart's order) waits for
the server to answer instead of failing at once: a GPU server takes a minute or more to start.

Driven with an injected HTTP getter and wait: no sleeping, no network, no wall-clock asserts.
"""

from __future__ import annotations

import httpx
import pytest

from deltasync.cli._vllm import START_POLL, wait_until_answering


def test_connection_errors_are_waited_out_with_one_line_naming_the_url() -> None:
    calls: list[str] = []
    said: list[str] = []
    waits: list[float] = []
    down = {"http://a:8000/health": 3, "http://b:8000/health": 0}

    def get(url: str) -> httpx.Response:
        calls.append(url)
        if down[url]:
            down[url] -= 1
            raise httpx.ConnectError("connection refused", request=httpx.Request("GET", url))
        return httpx.Response(503)  # any answer ends the wait: init then says what is wrong

    def wait(seconds: float) -> bool:
        waits.append(seconds)
        return False

    wait_until_answering(["http://a:8000/", "http://b:8000"], get=get, wait=wait, say=said.append)
    assert calls == ["http://a:8000/health"] * 4 + ["http://b:8000/health"]
    assert waits == [START_POLL] * 3
    assert len(said) == 1 and said[0].startswith(
        "waiting for the vLLM server at http://a:8000/ to answer (ConnectError"
    )


def test_a_stop_ends_the_wait() -> None:
    def get(url: str) -> httpx.Response:
        raise httpx.ConnectTimeout("timed out", request=httpx.Request("GET", url))

    waits: list[float] = []

    def wait(seconds: float) -> bool:
        waits.append(seconds)
        return len(waits) == 2  # Ctrl-C during the second wait

    wait_until_answering(["http://a:8000"], get=get, wait=wait, say=lambda _: None)
    assert waits == [START_POLL, START_POLL]


def test_other_errors_are_not_waited_out() -> None:
    def get(url: str) -> httpx.Response:
        raise ValueError("not a transport error")

    with pytest.raises(ValueError):
        wait_until_answering(["http://a:8000"], get=get, wait=lambda s: False, say=lambda _: None)
