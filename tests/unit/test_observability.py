"""Logs carry trace ids, trace context crosses headers, and the HTTP endpoint answers."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import urllib.error
import urllib.request
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshforge.ops.observability import (
    Metrics,
    bind_trace,
    configure_logging,
    consumer_span,
    current_trace,
    inject_trace,
    observe_many,
    serve_http,
)

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE}-{SPAN}-01"


@pytest.fixture
def log_stream() -> Any:
    stream = io.StringIO()
    handler = configure_logging("DEBUG", json=True, stream=stream)
    yield stream
    logging.getLogger().removeHandler(handler)


def _records(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


def test_json_log_lines_carry_the_message_trace(log_stream: io.StringIO) -> None:
    log = logging.getLogger("meshforge.test")
    log.info("outside")
    with consumer_span("cmd.x process", {"traceparent": TRACEPARENT}):
        log.info("inside %s", "span", extra={"subject": "cmd.x"})
    out = _records(log_stream)
    assert out[0]["message"] == "outside" and out[0]["trace_id"] is None
    assert out[1]["message"] == "inside span"
    assert out[1]["trace_id"] == TRACE
    assert out[1]["span_id"] == SPAN  # no SDK: the handler runs in the message's span
    assert out[1]["subject"] == "cmd.x"
    assert out[1]["level"] == "INFO" and out[1]["logger"] == "meshforge.test"


def test_bound_ids_are_used_when_no_span_is_current(log_stream: io.StringIO) -> None:
    with bind_trace("a" * 32, "b" * 16):
        assert current_trace() == ("a" * 32, "b" * 16)
        logging.getLogger("meshforge.test").warning("bound")
    assert current_trace() is None
    assert _records(log_stream)[0]["trace_id"] == "a" * 32


def test_configure_logging_replaces_its_own_handler() -> None:
    first = configure_logging("INFO", json=False, stream=io.StringIO())
    second = configure_logging("INFO", json=True, stream=io.StringIO())
    try:
        assert first not in logging.getLogger().handlers
        assert second in logging.getLogger().handlers
    finally:
        logging.getLogger().removeHandler(second)


def test_text_logs_also_show_the_trace() -> None:
    stream = io.StringIO()
    handler = configure_logging("INFO", json=False, stream=stream)
    try:
        with consumer_span("x", {"traceparent": TRACEPARENT}):
            logging.getLogger("meshforge.test").info("hello")
    finally:
        logging.getLogger().removeHandler(handler)
    assert f"[trace={TRACE}]" in stream.getvalue()


def test_trace_context_goes_back_into_headers() -> None:
    assert inject_trace({}) == {}  # no current span: nothing invented
    with consumer_span("x", {"Traceparent": TRACEPARENT}):
        headers = inject_trace({"Nats-Msg-Id": "1"})
    assert headers["traceparent"] == TRACEPARENT
    assert headers["Nats-Msg-Id"] == "1"


def test_a_span_without_parent_is_harmless() -> None:
    with consumer_span("x", None) as span:
        assert not span.is_recording()
    with pytest.raises(ValueError), consumer_span("x", {"traceparent": "garbage"}):
        raise ValueError("boom")


def _get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read()


async def test_http_endpoint_serves_health_readiness_and_metrics() -> None:
    metrics = Metrics()
    metrics.acked.labels(consumer="order_consumer").inc(3)
    state = {"ready": False, "health": {"state": "connected", "server": "nats://x"}}

    async def health() -> dict[str, Any]:
        return dict(state["health"])  # type: ignore[call-overload]

    endpoint = await serve_http("127.0.0.1", 0, metrics, health, lambda: bool(state["ready"]))
    base = f"http://127.0.0.1:{endpoint.port}"
    try:
        code, ctype, body = await asyncio.to_thread(_get, base + "/healthz")
        assert (code, ctype) == (200, "application/json")
        assert json.loads(body)["server"] == "nats://x"

        code, _, body = await asyncio.to_thread(_get, base + "/readyz")
        assert code == 503 and json.loads(body) == {"ready": False}
        state["ready"] = True
        code, _, body = await asyncio.to_thread(_get, base + "/readyz")
        assert code == 200 and json.loads(body) == {"ready": True}

        code, ctype, body = await asyncio.to_thread(_get, base + "/metrics")
        assert code == 200 and ctype.startswith("text/plain")
        assert 'meshforge_acked_total{consumer="order_consumer"} 3.0' in body.decode()

        state["health"] = {"state": "reconnecting"}
        code, _, _ = await asyncio.to_thread(_get, base + "/healthz")
        assert code == 503

        async def broken() -> dict[str, Any]:
            raise RuntimeError("store down")

        other = await serve_http("127.0.0.1", 0, metrics, broken, lambda: True)
        try:
            code, _, body = await asyncio.to_thread(_get, f"http://127.0.0.1:{other.port}/healthz")
            assert code == 503 and "store down" in json.loads(body)["error"]
        finally:
            await other.close()

        code, _, _ = await asyncio.to_thread(_get, base + "/nothing")
        assert code == 404
    finally:
        await endpoint.close()


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.sampled_from([0.0, 0.001, 0.0011, 0.5, 60.0, 61.0]) | st.floats(0, 100), max_size=40
    )
)
def test_observe_many_records_what_observing_each_records(amounts: list[float]) -> None:
    one, many = Metrics(), Metrics()
    child = one.end_to_end_seconds.labels(consumer="c")
    for amount in amounts:
        child.observe(amount)
    observe_many(many.end_to_end_seconds.labels(consumer="c"), amounts)

    def samples(m: Metrics) -> list[tuple[str, dict[str, str], float]]:
        return [(s.name, s.labels, round(s.value, 6)) for f in m.end_to_end_seconds.collect() for s in f.samples
                if not s.name.endswith("_created")]  # fmt: skip

    assert samples(one) == samples(many)
