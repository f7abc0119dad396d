"""The demo's check from outside counts every event message, not the set of their ids."""

from __future__ import annotations

from meshforge.cli.demo import effects_seen
from meshforge.cli.demo_support import StreamMessage
from meshforge.envelope import Envelope, Outbound


def message(seq: int, subject: str, env: Envelope) -> StreamMessage:
    out = Outbound.of(subject, env)
    return StreamMessage(subject, seq, out.headers, out.data)


def test_an_order_event_stored_twice_is_a_doubled_effect() -> None:
    create = Envelope.new("order.create", {"order_id": "o-1", "sku": "A", "qty": 1})
    created = message(
        1, "evt.default.demo.order.created", create.child("order.created", {"order_id": "o-1"}, 0)
    )
    reserve = create.child("inventory.reserve", {"order_id": "o-1"}, 1)
    reserved = message(2, "evt.default.demo.inventory.reserved",
                       reserve.child("inventory.reserved", {"order_id": "o-1"}, 0))  # fmt: skip
    sent = {create.id: "o-1"}
    once = effects_seen([created, reserved], sent)
    assert ({k: len(v) for k, v in once[0].items()}, {k: len(v) for k, v in once[1].items()}, once[2]) == (
        {create.id: 1}, {"o-1": 1}, 1)  # fmt: skip
    # The same message again at a later seq: published again after the duplicate window.
    again = StreamMessage(created.subject, 3, created.headers, created.data)
    by_order, _, _ = effects_seen([created, reserved, again], sent)
    assert by_order[create.id] == [created.envelope().id] * 2  # type: ignore[union-attr]
