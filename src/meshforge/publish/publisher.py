"""Publish to JetStream with message ids, retries with backoff, and pipelined batches.

Every publish waits for the server's PubAck and carries a ``Nats-Msg-Id`` (the envelope
id, the given ``msg_id``, or a fresh one), so a retried attempt whose first PubAck was
lost is stored once and reported as ``duplicate``. Transient failures (timeout, no
responders during a server restart, connection lost) are retried with exponential
backoff and full jitter; permanent ones (permission denied, payload too large, invalid
subject, wrong last sequence) raise ``PublishError`` at once. A message over the server's
``max_payload`` or JetStream's header limit is refused before it is sent (the server would
close the connection); ``Publisher.fit`` makes a message fit by truncating it.

Example::

    publisher = Publisher(conn.js, settings, metrics)
    env = Envelope.new("order.create", {"sku": "A-1", "qty": 2})
    result = await publisher.publish("cmd.default.demo.order.create", env)
    print(result.stream, result.seq, result.duplicate)
    results = await publisher.publish_many([Outbound.of(subject, e) for e in envs])

    # A typed command: subject and type from the agent's declaration (publish.typed).
    result = await publisher.send(OrderAgent, PlaceOrder(order_id="o-1", sku="A-1", qty=2))
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import PubAck

from meshforge.config import Settings, load_settings
from meshforge.envelope import H_MSG_ID, Envelope, Outbound
from meshforge.errors import InvalidSubject, PublishError, one_line
from meshforge.ops.observability import Metrics
from meshforge.publish.typed import addressed
from meshforge.topology.subjects import validate_subject
from meshforge.transport.pubacks import Message, PubAckPipe
from meshforge.transport.sizes import (
    DEFAULT_MAX_PAYLOAD,
    Fitted,
    SizeLimits,
    check_fits,
    fit_message,
)

__all__ = [
    "NO_STREAM_ATTEMPTS",
    "Fitted",
    "Message",
    "PublishResult",
    "Publisher",
    "SizeLimits",
    "classify",
]

log = logging.getLogger("meshforge.publisher")

# "No stream" is only worth retrying while a restarting server loads its streams.
NO_STREAM_ATTEMPTS = 3

# JetStream error codes (server errors.json) that name a permanent refusal.
_ERR_TOO_LARGE = 10054
_ERR_WRONG_LAST_MSG_ID = 10070
_ERR_WRONG_LAST_SEQ = 10071
_ERR_STREAM_MISMATCH = 10060
_ERR_STORE_FAILED = 10077


@functools.lru_cache(maxsize=4096)
def _subject_ok(subject: str) -> bool:
    """Whether ``subject`` may be published to; cached, as a batch repeats few subjects."""
    try:
        validate_subject(subject)
    except InvalidSubject:
        return False
    return True


@dataclass(frozen=True, slots=True)
class PublishResult:
    """The PubAck of one message: where it is stored and whether it was a duplicate."""

    stream: str
    seq: int
    duplicate: bool
    msg_id: str | None


def _permission_denied(js: JetStreamContext, subject: str) -> str | None:
    """The server's permissions error for ``subject``, if the client saw one.

    The server answers a forbidden publish with an asynchronous ``-ERR`` and no reply,
    so the request only times out; the client keeps the error as ``last_error``.
    """
    nc = getattr(js, "_nc", None)
    err = getattr(nc, "last_error", None) if nc is not None else None
    text = str(err) if err is not None else ""
    # nats-py lower-cases the server's -ERR text, subject included.
    if (
        "permissions violation for publish" in text.lower()
        and f'"{subject.lower()}"' in text.lower()
    ):
        return text.removeprefix("nats: ")
    return None


def classify(exc: BaseException, subject: str, js: JetStreamContext | None = None) -> PublishError:
    """Turn a nats-py exception from a publish to ``subject`` into a ``PublishError``.

    ``kind`` names the failure (``timeout``, ``no_stream``, ``connection``, ``closed``,
    ``unavailable``, ``permission_denied``, ``payload_too_large``, ``wrong_last_seq``,
    ``invalid_subject``, ...); ``retriable`` says whether trying again may succeed.
    """
    if isinstance(exc, PublishError):
        return exc
    if isinstance(exc, InvalidSubject):
        return PublishError(str(exc), kind="invalid_subject")
    detail = one_line(exc, 300)
    if isinstance(exc, nats.js.errors.NoStreamResponseError | nats.errors.NoRespondersError):
        return PublishError(
            f"no stream captures subject {subject!r} (or JetStream is not answering): "
            "create the streams with `meshforge provision`",
            kind="no_stream",
            retriable=True,
        )
    if isinstance(exc, nats.errors.MaxPayloadError):
        limit = getattr(getattr(js, "_nc", None), "max_payload", None)
        return PublishError(
            f"message to {subject!r} exceeds the server's max_payload"
            f"{f' of {limit} bytes' if isinstance(limit, int) else ''}: send less, or raise "
            "max_payload in the server configuration",
            kind="payload_too_large",
        )
    if isinstance(exc, nats.errors.ConnectionClosedError | nats.errors.ConnectionDrainingError):
        # A closed nats-py client never comes back: retrying would only wait.
        return PublishError(f"publish to {subject!r}: the NATS connection is closed", kind="closed")
    if isinstance(
        exc,
        nats.errors.ConnectionReconnectingError
        | nats.errors.OutboundBufferLimitError
        | nats.errors.StaleConnectionError
        | nats.errors.FlushTimeoutError,
    ):
        return PublishError(
            f"publish to {subject!r}: connection lost ({detail})", kind="connection", retriable=True
        )
    if isinstance(exc, nats.errors.TimeoutError | asyncio.TimeoutError | TimeoutError):
        denied = _permission_denied(js, subject) if js is not None else None
        if denied:
            return PublishError(
                f"publish to {subject!r} refused: {denied}", kind="permission_denied"
            )
        return PublishError(
            f"publish to {subject!r}: no PubAck in time", kind="timeout", retriable=True
        )
    if isinstance(exc, nats.errors.BadSubjectError):
        return PublishError(f"invalid subject {subject!r}: {detail}", kind="invalid_subject")
    if isinstance(exc, nats.errors.BadHeaderError):
        return PublishError(
            f"publish to {subject!r}: invalid header: {detail}", kind="invalid_header"
        )
    if isinstance(exc, nats.js.errors.APIError):
        return _classify_api(exc, subject)
    if isinstance(exc, nats.errors.Error):
        text = str(exc)
        if "permissions violation" in text.lower():
            return PublishError(f"publish to {subject!r} refused: {text}", kind="permission_denied")
        return PublishError(f"publish to {subject!r}: {detail}", kind="error")
    return PublishError(f"publish to {subject!r}: {detail}", kind="error")


def _classify_api(exc: nats.js.errors.APIError, subject: str) -> PublishError:
    code, err_code = exc.code or 0, exc.err_code or 0
    what = f"publish to {subject!r} refused by JetStream: {exc.description or 'error'} (code {code}/{err_code})"
    if err_code == _ERR_TOO_LARGE:
        return PublishError(what, kind="payload_too_large")
    if err_code == _ERR_WRONG_LAST_SEQ:
        return PublishError(what, kind="wrong_last_seq")
    if err_code == _ERR_WRONG_LAST_MSG_ID:
        return PublishError(what, kind="wrong_last_msg_id")
    if err_code == _ERR_STREAM_MISMATCH:
        return PublishError(what, kind="stream_mismatch")
    if err_code == _ERR_STORE_FAILED:
        # A full discard-new stream (work queue) frees space as consumers catch up.
        return PublishError(what, kind="store_failed", retriable=True)
    if code in (500, 503) or isinstance(exc, nats.js.errors.ServiceUnavailableError):
        return PublishError(what, kind="unavailable", retriable=True)
    return PublishError(what, kind="rejected")


async def _settled(fut: asyncio.Future[PubAck]) -> None:
    """Wait until ``fut`` is done, whatever its outcome (the caller reads it later)."""
    try:
        await fut
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # this task is being cancelled, not just the future
    except Exception:  # the outcome is read from the future afterwards
        pass


class _Watchdog:
    """Fails each PubAck future not done ``timeout`` seconds after its message left.

    One timer for a whole pipeline, moved along to the oldest open message's deadline.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.futures: list[asyncio.Future[PubAck] | None] = []
        self.sent_at: list[float] = []
        self._head = 0
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = self._loop.call_later(timeout, self._check)

    def _check(self) -> None:
        now = time.monotonic()
        futures, sent_at = self.futures, self.sent_at
        while self._head < len(futures):
            fut = futures[self._head]
            if fut is not None and not fut.done():
                if sent_at[self._head] + self.timeout > now:
                    break
                # Failing the future also frees its place in nats-py's pending PubAcks.
                fut.set_exception(nats.errors.TimeoutError())
            self._head += 1
        wait = self.timeout
        if self._head < len(futures):
            wait = max(0.0, sent_at[self._head] + self.timeout - now)
        self._timer = self._loop.call_later(wait, self._check)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class Publisher:
    """Publishes envelopes or bytes and waits for the PubAck; retries what may succeed.

    Settings used: ``publish_timeout`` (per attempt), ``publish_attempts``,
    ``publish_backoff_base`` and ``publish_backoff_cap`` (exponential backoff, full jitter).
    """

    def __init__(
        self,
        js: JetStreamContext,
        settings: Settings | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.js = js
        self.settings = settings if settings is not None else load_settings()
        self.metrics = metrics if metrics is not None else Metrics.default()
        self._limits = SizeLimits()

    # ------------------------------------------------------------------ single
    async def publish(
        self,
        subject: str,
        data: Envelope | bytes,
        *,
        headers: dict[str, str] | None = None,
        msg_id: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109  # per attempt, part of the API
    ) -> PublishResult:
        """Publish one message and wait for its PubAck; raise ``PublishError`` on failure.

        An ``Envelope`` is encoded with its headers (plus ``headers``) and its id as
        ``Nats-Msg-Id``; bytes go as they are with ``headers``. ``msg_id`` overrides the id.

        Example::

            r = await publisher.publish("evt.default.demo.order.created", b"{...}", msg_id="e-1")
        """
        try:
            item = self._outbound(subject, data, headers, msg_id, self.limits())
        except PublishError as refused:
            self._failed(refused, 0)
            raise
        timeout = self.settings.publish_timeout if timeout is None else timeout
        attempt = 0
        while True:
            attempt += 1
            try:
                ack = await self.js.publish(
                    item.subject, item.data, timeout=timeout, headers=dict(item.headers)
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # every nats-py failure is classified below
                err = classify(exc, item.subject, self.js)
                if not self._retry(err, attempt):
                    self._failed(err, attempt)
                    raise err from exc
                await asyncio.sleep(self._delay(attempt))  # backoff before the next attempt
                continue
            return self._succeeded(ack, item.msg_id)

    async def send(
        self,
        agent: object,
        payload: Any,
        *,
        tenant: str | None = None,
        namespace: str | None = None,
        resource_id: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109  # per attempt, as publish's
        **envelope_fields: Any,
    ) -> PublishResult:
        """Send typed ``payload`` to the command of agent class ``agent`` that declares its
        type, on the subject that declaration gives; ``ConfigError`` if no command (or
        more than one) takes it. See ``meshforge.publish.typed.addressed`` for the defaults
        of ``tenant``, ``namespace`` and ``resource_id``; ``envelope_fields`` (e.g.
        ``idempotency_key``) go to ``Envelope.new``. The result's ``msg_id`` is the
        envelope's id.

        Example::

            await publisher.send(OrderAgent, PlaceOrder(order_id="o-1", qty=2), tenant="acme")
        """
        subject, env = addressed(
            agent, payload, self.settings, tenant=tenant, namespace=namespace,
            resource_id=resource_id, **envelope_fields,
        )  # fmt: skip
        return await self.publish(subject, env, timeout=timeout)

    # ------------------------------------------------------------------ many
    async def publish_many(
        self, items: Sequence[Message], *, max_in_flight: int = 256, checked: bool = False
    ) -> list[PublishResult]:
        """Publish many messages pipelined; one result per item, in order.

        Up to ``max_in_flight`` PubAcks are awaited at once; messages leave in the order
        given, so they are stored in that order unless one needs a retry. Raises
        ``PublishError`` naming the index of the first message that failed for good
        (after the others finished); ``publish_each`` returns per-item outcomes instead.
        ``checked``: the caller already made sure every item fits the size limits (see
        ``publish_each``).

        Example::

            results = await publisher.publish_many([Outbound.of(s, env) for env in envs])
        """
        outcomes = await self.publish_each(items, max_in_flight=max_in_flight, checked=checked)
        for index, outcome in enumerate(outcomes):
            if type(outcome) is not PublishResult and isinstance(outcome, PublishError):
                failed = sum(isinstance(o, PublishError) for o in outcomes)
                raise PublishError(
                    f"message {index} of {len(outcomes)} (msg id {items[index].msg_id!r}) failed"
                    f"{f' ({failed} failed in all)' if failed > 1 else ''}: {outcome}",
                    kind=outcome.kind,
                    retriable=outcome.retriable,
                ) from outcome
        return outcomes  # type: ignore[return-value]  # no PublishError among them

    async def publish_each(
        self, items: Sequence[Message], *, max_in_flight: int = 256, checked: bool = False
    ) -> list[PublishResult | PublishError]:
        """Like ``publish_many`` but never raises for a message: each item gets its
        ``PublishResult`` or the ``PublishError`` that ended it.

        Retriable failures are retried in rounds (all failed messages of a round are
        pipelined again after one backoff), each message within its own attempt budget.
        ``checked``: the caller already checked every item against ``limits()`` (the
        engine does, before it stores an output), so an item that carries its id as its
        ``Nats-Msg-Id`` is not measured again. (On a MeshForge connection a message over
        ``max_payload`` is still refused before it is sent.)
        """
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        outcomes: list[PublishResult | PublishError | None] = [None] * len(items)
        ready: list[Message] = []
        pending: list[int] = []
        limits = self.limits()
        good = {subject for subject in {item.subject for item in items} if _subject_ok(subject)}
        for index, item in enumerate(items):
            try:
                # A bytes item that already carries its id and a checked subject goes as is.
                if (
                    item.subject in good
                    and type(item.data) is bytes
                    and item.msg_id
                    and item.headers.get(H_MSG_ID) == item.msg_id
                ):
                    if not checked:
                        check_fits(item.subject, item.data, item.headers, limits)
                    ready.append(item)
                else:
                    ready.append(
                        self._outbound(item.subject, item.data, item.headers, item.msg_id, limits)
                    )
                pending.append(index)
            except PublishError as refused:
                self._failed(refused, 0)
                outcomes[index] = refused
                ready.append(item)
        attempts = [0] * len(items)
        # stream -> messages stored (or found duplicate), counted once per call
        stored: dict[str, int] = {}
        duplicates: dict[str, int] = {}
        round_ = 0
        while pending:
            round_ += 1
            answers = await self._pipeline([ready[i] for i in pending], max_in_flight)
            retry: list[int] = []
            for index, answer in zip(pending, answers, strict=True):
                attempts[index] += 1
                if isinstance(answer, PubAck):
                    duplicate = bool(answer.duplicate)
                    counts = duplicates if duplicate else stored
                    counts[answer.stream] = counts.get(answer.stream, 0) + 1
                    outcomes[index] = PublishResult(
                        answer.stream, answer.seq, duplicate, ready[index].msg_id
                    )
                    continue
                err = classify(answer, ready[index].subject, self.js)
                if self._retry(err, attempts[index]):
                    retry.append(index)
                else:
                    self._failed(err, attempts[index])
                    outcomes[index] = err
            pending = retry
            if pending:
                log.debug("retrying %d of %d messages (round %d)", len(pending), len(items), round_)
                await asyncio.sleep(self._delay(round_))  # backoff before the next round
        for stream, count in stored.items():
            self.metrics.published.labels(stream=stream).inc(count)
        for stream, count in duplicates.items():
            self.metrics.publish_duplicates.labels(stream=stream).inc(count)
        return [o for o in outcomes if o is not None]

    async def _pipeline(
        self, items: Sequence[Message], max_in_flight: int
    ) -> list[PubAck | BaseException]:
        """Send every item in order with at most ``max_in_flight`` PubAcks outstanding.

        Message ``i`` leaves once message ``i - max_in_flight`` is answered; when it is
        not, the window waits for the first quarter of itself: PubAcks come back in order,
        so this costs nothing until the window is full, and there is no semaphore, timer
        or callback per message. One watchdog fails a PubAck not back
        ``publish_timeout`` after its message left as a timeout. On a MeshForge connection
        the window goes through its lean path instead (``meshforge.transport.pubacks``).
        """
        pubacks = getattr(getattr(self.js, "_nc", None), "pubacks", None)
        if pubacks is not None:
            pipe: PubAckPipe = pubacks()
            return await pipe.publish(
                items, max_in_flight=max_in_flight, answer_within=self.settings.publish_timeout
            )
        publish = self.js.publish_async
        clock = time.monotonic
        watch = _Watchdog(self.settings.publish_timeout)
        futures, sent_at = watch.futures, watch.sent_at
        refused: dict[int, BaseException] = {}
        # A full window waits for a quarter of it to come back, not for one PubAck, then
        # lets nats-py's own callbacks free those places in its pending count: the messages
        # it then sends leave in one write. (Sent at once, its count would still be full,
        # and each message would wait in it for a PubAck and a write of its own.)
        drain = max(1, max_in_flight // 4)
        stamp = clock()
        try:
            for index, item in enumerate(items):
                if index >= max_in_flight:
                    oldest = futures[index - max_in_flight]
                    if oldest is not None and not oldest.done():
                        await _settled(futures[index - max_in_flight + drain - 1] or oldest)
                        await asyncio.sleep(0)
                        stamp = clock()
                if not index & 63:
                    stamp = clock()  # a clock read per 64 messages is close enough
                try:
                    fut = await publish(item.subject, item.data, headers=item.headers)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # refused before sending (size, connection state)
                    refused[index] = exc
                    fut = None
                futures.append(fut)
                sent_at.append(stamp)
            for waiting in futures:
                if waiting is not None and not waiting.done():
                    await _settled(waiting)
        except asyncio.CancelledError:
            for waiting in futures:
                if waiting is not None:
                    waiting.cancel()
            raise
        finally:
            watch.close()
        answers: list[PubAck | BaseException] = []
        for index, waiting in enumerate(futures):
            if waiting is None:
                answers.append(refused[index])
            elif waiting.cancelled():
                answers.append(nats.errors.TimeoutError())
            else:
                error = waiting.exception()
                answers.append(error if error is not None else waiting.result())
        return answers

    # ------------------------------------------------------------------ sizes
    def limits(self) -> SizeLimits:
        """The limits every message must respect: the connected server's ``max_payload``
        (from its INFO; 1 MiB before the first) and JetStream's 64 KiB header block."""
        nc = getattr(self.js, "_nc", None)
        max_payload = getattr(nc, "_max_payload", None)
        if not isinstance(max_payload, int) or max_payload <= 0:
            max_payload = DEFAULT_MAX_PAYLOAD
        if self._limits.max_payload != max_payload:
            self._limits = SizeLimits(max_payload=max_payload)
        return self._limits

    def fit(
        self,
        subject: str,
        data: bytes,
        headers: Mapping[str, str],
        *,
        mark: str | None = None,
        keep: Collection[str] = (),
    ) -> Fitted:
        """``data`` and ``headers`` made to fit this server's limits (see ``sizes.fit_message``).

        Without ``mark`` a message over a limit raises ``PublishError``
        (``payload_too_large``); with it, long headers not in ``keep`` are dropped, the body
        is cut, and header ``mark`` says what was cut and the original sizes. Count the
        ``Nats-Msg-Id`` in: put it in ``headers`` (and ``keep``) before fitting.

        Example::

            fitted = publisher.fit(subject, body, headers, mark="Dlq-Truncated", keep=kept)
            await publisher.publish(subject, fitted.data, headers=fitted.headers)
        """
        return fit_message(subject, data, headers, self.limits(), mark=mark, keep=keep)

    # ------------------------------------------------------------------ internals
    def _outbound(
        self,
        subject: str,
        data: Envelope | bytes,
        headers: dict[str, str] | None,
        msg_id: str | None,
        limits: SizeLimits,
    ) -> Outbound:
        try:
            validate_subject(subject)
        except InvalidSubject as exc:
            raise PublishError(str(exc), kind="invalid_subject") from None
        if isinstance(data, Envelope):
            data = data.addressed_to(subject)
            body = data.encode()
            hdrs = data.headers()
            hdrs.update(headers or {})
            msg_id = msg_id or data.id
        elif isinstance(data, bytes | bytearray | memoryview):
            body = bytes(data)
            hdrs = dict(headers or {})
            msg_id = msg_id or hdrs.get(H_MSG_ID)
        else:
            raise PublishError(
                f"publish to {subject!r}: data must be an Envelope or bytes, got {type(data).__name__}",
                kind="invalid_data",
            )
        # Without an id a retried attempt could be stored twice; with one it cannot.
        msg_id = msg_id or str(uuid.uuid4())
        hdrs[H_MSG_ID] = msg_id
        # Over max_payload the server closes the connection: refuse before sending.
        check_fits(subject, body, hdrs, limits)
        return Outbound(subject=subject, data=body, headers=hdrs, msg_id=msg_id)

    def _limit(self, kind: str) -> int:
        attempts = max(1, self.settings.publish_attempts)
        if kind == "no_stream" and not self._clustered():
            return min(attempts, NO_STREAM_ATTEMPTS)
        return attempts

    def _clustered(self) -> bool:
        """Connected to a cluster, where "no responders" is also a stream electing its leader."""
        info = getattr(getattr(self.js, "_nc", None), "_server_info", None)
        return isinstance(info, dict) and bool(info.get("cluster"))

    def _retry(self, err: PublishError, attempt: int) -> bool:
        if not err.retriable or attempt >= self._limit(err.kind):
            return False
        self.metrics.publish_retries.labels(kind=err.kind).inc()
        log.debug("publish attempt %d failed, retrying: %s", attempt, err)
        return True

    def _delay(self, attempt: int) -> float:
        s = self.settings
        return random.uniform(
            0, min(s.publish_backoff_cap, s.publish_backoff_base * 2 ** (attempt - 1))
        )

    def _failed(self, err: PublishError, attempts: int) -> None:
        self.metrics.publish_failures.labels(kind=err.kind).inc()
        # The caller gets the error and decides; the log only keeps the trail.
        log.info("publish failed after %d attempt(s): %s", attempts, err)

    def _succeeded(self, ack: PubAck, msg_id: str | None) -> PublishResult:
        duplicate = bool(ack.duplicate)
        if duplicate:
            self.metrics.publish_duplicates.labels(stream=ack.stream).inc()
        else:
            self.metrics.published.labels(stream=ack.stream).inc()
        return PublishResult(stream=ack.stream, seq=ack.seq, duplicate=duplicate, msg_id=msg_id)
