"""Helpers for the Spark tests: publishing with plain nats-py, reading results back."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import nats
from nats.js import JetStreamContext

from meshforge.envelope import Envelope, Outbound


async def publish_many(
    js: JetStreamContext, subject: str, count: int, *, start: int = 0, headers: bool = True
) -> None:
    """Publish ``count`` small JSON bodies ``{"i": n}`` with headers, in flight together."""
    futures = [
        js.publish(
            subject,
            b'{"i":%d}' % i,
            headers={"Nats-Msg-Id": f"m-{subject}-{i}", "X-Index": str(i)} if headers else None,
        )
        for i in range(start, start + count)
    ]
    for i in range(0, len(futures), 500):
        await asyncio.gather(*futures[i : i + 500])


#: What ``publish_pipeline_run`` sends: order events, each the effect of its own command,
#: and dead letters.
EVENTS = 200
DEAD_LETTERS = 5


async def publish_pipeline_run(url: str) -> None:
    """EVENTS order events and DEAD_LETTERS dead letters into fresh MESHFORGE_* streams."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(name="MESHFORGE_EVENTS", subjects=["evt.>"])
    await js.add_stream(name="MESHFORGE_FAILED", subjects=["failed.>"])
    for i in range(EVENTS):
        cmd = Envelope.new("order.create", {"order_id": f"o-{i}", "sku": "S", "qty": 1})
        out = Outbound.of(
            "evt.default.demo.order.created",
            cmd.child("order.created", {"order_id": f"o-{i}"}, position=0),
        )
        await js.publish(out.subject, out.data, headers=out.headers)
    for i in range(DEAD_LETTERS):
        bad = Envelope.new("order.create", {"qty": -i})
        out = Outbound.of("failed.cmd.default.demo.order.create", bad)
        headers = {**out.headers, "Dlq-Reason": "unrecoverable", "Dlq-Error": "Unrecoverable: qty",
                   "Dlq-Original-Subject": "cmd.default.demo.order.create"}  # fmt: skip
        await js.publish(out.subject, out.data, headers=headers)
    await nc.close()


def pipeline_report(out: Path) -> dict[str, Any]:
    """The parts of ``audit.json`` that do not depend on where or when the audit ran."""
    findings = json.loads((out / "report" / "audit.json").read_text())
    assert isinstance(findings, dict)
    return {key: findings[key] for key in ("ok", "counts", "dead_letters")}


_LETTER = {"reason": "unrecoverable", "subject": "cmd.default.demo.order.create",
           "error": "Unrecoverable: qty", "deliveries": None}  # fmt: skip
#: ``pipeline_report`` of ``publish_pipeline_run``'s streams, ingested and audited without a
#: store: what local mode gives (test_cli.py) and a standalone cluster must give too
#: (test_standalone.py).
PIPELINE_REPORT: dict[str, Any] = {
    "ok": True,
    "counts": {"events": EVENTS, "event_ids": EVENTS, "events_by_type": {"order.created": EVENTS},
               "commands": None, "effects": None, "duplicate_effects": 0, "doubled_outputs": 0,
               "missing_effects": 0, "lost_outputs": 0},
    "dead_letters": {"total": DEAD_LETTERS, "by_reason": {"unrecoverable": DEAD_LETTERS},
                     "by_subject": {"cmd.default.demo.order.create": DEAD_LETTERS},
                     "examples": [_LETTER] * DEAD_LETTERS},
}  # fmt: skip
