"""The private parts of nats-py that MeshForge's client builds on (meshforge.transport.connection:
its parser and its message hand-off). A nats-py release that moves them must fail here,
loudly and by name, before anything runs on a changed client: pyproject.toml bounds
nats-py to the releases this was checked on."""

from __future__ import annotations

import inspect

import pytest
from nats.aio.client import Client
from nats.protocol import parser

METHODS = {
    "_process_msg": ["self", "sid", "subject", "reply", "data", "headers"],
    "_build_message": ["self", "sid", "subject", "reply", "data", "headers"],
    "_process_headers": ["self", "headers"],
    "_send_command": ["self", "cmd", "priority"],
    "_flush_pending": ["self", "force_flush"],
    "_process_op_err": ["self", "e"],
    "_process_err": ["self", "err_msg"],
}
ATTRIBUTES = ["_subs", "_ps", "_error_cb", "_flush_queue"]
PARSER_STATE = ["AWAITING_CONTROL_LINE", "AWAITING_MSG_PAYLOAD", "MSG_RE", "HMSG_RE", "CRLF_SIZE"]


@pytest.mark.parametrize("name", sorted(METHODS))
def test_client_methods_keep_their_parameters(name: str) -> None:
    method = getattr(Client, name, None)
    assert method is not None, (
        f"nats-py's Client has no {name} any more: see meshforge.transport.connection"
    )
    params = list(inspect.signature(method).parameters)
    assert params[: len(METHODS[name])] == METHODS[name], f"nats-py's Client.{name}{params} moved"


def test_client_attributes_are_still_set() -> None:
    code = Client.__init__.__code__.co_names + Client.connect.__code__.co_names
    for name in ATTRIBUTES:
        assert hasattr(Client, name) or name in code, f"nats-py's Client no longer sets {name}"


def test_parser_states_and_patterns_are_still_there() -> None:
    for name in PARSER_STATE:
        assert hasattr(parser, name), (
            f"nats.protocol.parser.{name} is gone: see meshforge.transport.connection._Parser"
        )
    assert list(inspect.signature(parser.Parser.parse).parameters) == ["self", "data"]
