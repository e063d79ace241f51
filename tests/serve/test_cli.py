"""``beaconkv serve``'s server options: the body limit is an option with a safe default."""

from __future__ import annotations

import argparse

import pytest

from beaconkv.serve.cli import add_serve_arguments
from beaconkv.serve.limits import DEFAULT_MAX_REQUEST_BYTES


def test_max_request_bytes_is_an_option_of_positive_bytes(capsys):
    parser = add_serve_arguments(argparse.ArgumentParser())
    assert parser.parse_args([]).max_request_bytes == DEFAULT_MAX_REQUEST_BYTES == 4 * 2**20
    assert parser.parse_args(["--max-request-bytes", "65536"]).max_request_bytes == 65536
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-request-bytes", "0"])
    assert "--max-request-bytes" in capsys.readouterr().err
