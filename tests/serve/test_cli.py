"""``beaconkv serve``'s server options: the limits are options with safe defaults (and help that states them
right), the allowed hosts default to localhost and the bind address, and the file-descriptor limit makes room for
``--max-connections`` or the command says what to do."""

from __future__ import annotations

import argparse
import resource

import pytest

from beaconkv.serve import cli
from beaconkv.serve.cli import ServeError, add_serve_arguments, allowed_hosts, ensure_file_limit, size_text
from beaconkv.serve.limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_ANSWER_TOKENS,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_TEMPLATE_TIMEOUT_S,
)


@pytest.fixture
def parser():
    return add_serve_arguments(argparse.ArgumentParser())


def test_max_request_bytes_is_an_option_of_positive_bytes(parser, capsys):
    assert parser.parse_args([]).max_request_bytes == DEFAULT_MAX_REQUEST_BYTES == 4 * 2**20
    assert parser.parse_args(["--max-request-bytes", "65536"]).max_request_bytes == 65536
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-request-bytes", "0"])
    assert "--max-request-bytes" in capsys.readouterr().err


def test_the_help_states_the_default_body_limit_right(parser):
    text = " ".join(parser.format_help().split())
    assert "default 4194304, 4 MiB" in text and "8 MiB" not in text
    assert size_text(4 * 2**20) == "4 MiB" and size_text(1536) == "1.5 KiB" and size_text(100) == "100 bytes"


def test_the_limits_are_options_with_their_defaults(parser):
    args = parser.parse_args([])
    limits, connections = cli.request_limits(args), cli.connection_limits(args)
    assert (limits.max_request_bytes, limits.body_timeout_s, limits.max_answer_tokens, limits.template_timeout_s) == (
        DEFAULT_MAX_REQUEST_BYTES, DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_ANSWER_TOKENS, DEFAULT_TEMPLATE_TIMEOUT_S)
    assert (connections.max_connections, connections.header_timeout_s) == (DEFAULT_MAX_CONNECTIONS,
                                                                          DEFAULT_HEADER_TIMEOUT_S)
    assert args.special_tokens_in_content == "escape"
    args = parser.parse_args(["--max-answer-tokens", "1000", "--max-connections", "64", "--header-timeout", "1.5",
                              "--body-timeout", "2", "--template-timeout", "0.5", "--special-tokens-in-content",
                              "refuse"])
    limits, connections = cli.request_limits(args), cli.connection_limits(args)
    assert (limits.max_answer_tokens, limits.body_timeout_s, limits.template_timeout_s) == (1000, 2.0, 0.5)
    assert (connections.max_connections, connections.header_timeout_s) == (64, 1.5)
    assert args.special_tokens_in_content == "refuse"


@pytest.mark.parametrize("option,value", [("--header-timeout", "0"), ("--body-timeout", "-1"),
                                          ("--template-timeout", "nan"), ("--template-timeout", "inf"),
                                          ("--max-connections", "0"), ("--max-answer-tokens", "-5"),
                                          ("--special-tokens-in-content", "keep")])
def test_limits_that_cannot_work_are_refused(parser, capsys, option, value):
    with pytest.raises(SystemExit):
        parser.parse_args([option, value])
    assert option in capsys.readouterr().err


def test_allowed_hosts_default_to_localhost_and_the_bind_address(parser):
    assert allowed_hosts(parser.parse_args([])) == ["localhost", "127.0.0.1", "::1"]
    assert allowed_hosts(parser.parse_args(["--host", "10.1.2.3"]))[-1] == "10.1.2.3"
    assert allowed_hosts(parser.parse_args(["--allowed-hosts", "api.example.com", "*"])) == ["api.example.com", "*"]
    with pytest.raises(ServeError, match="empty name"):
        allowed_hosts(parser.parse_args(["--allowed-hosts", "ok", " "]))


def test_the_file_limit_makes_room_for_the_connections(monkeypatch):
    calls = []
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 4096))
    monkeypatch.setattr(resource, "setrlimit", lambda which, limits: calls.append(limits))
    ensure_file_limit(512)
    assert calls == []  # 512 + 64 fit under 1024
    ensure_file_limit(2000)
    assert calls == [(2064, 4096)]  # the soft limit raised up to what is needed
    with pytest.raises(ServeError) as err:
        ensure_file_limit(5000)
    message = str(err.value)
    assert "--max-connections 5000" in message and "4096" in message and "--max-connections 4032" in message
    assert "ulimit -n" in message
