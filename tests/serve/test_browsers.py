"""A web page cannot drive the server: a body not declared ``application/json`` (a cross-site ``text/plain`` or
form POST, which a browser sends without asking) gets 415 before it is read, and a ``Host`` that is not one of the
server's names (DNS rebinding) gets 400; the host names are compared as names (case, port, brackets, IPv6 forms)."""

from __future__ import annotations

import json

import pytest

from beaconkv.serve.browsers import LOCAL_HOSTS, default_allowed_hosts, host_allowed, normalize_host

from .conftest import NAME, live_app

BODY = json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 1})


@pytest.fixture(scope="module")
def spied(tiny_served):
    """An app (localhost names only) whose engine counts what reaches it."""
    app = live_app(*tiny_served)
    try:
        yield app
    finally:
        app.close()


@pytest.mark.parametrize("content_type", [None, "text/plain", "text/plain;charset=UTF-8",
                                          "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                          "application/jsonp", "json"])
def test_a_body_not_declared_json_gets_415_before_it_is_read(spied, content_type):
    counters = spied.app.state.serve.worker.counters
    submitted, refused = counters.submitted, counters.refused["unsupported_media_type"]
    headers = {} if content_type is None else {"content-type": content_type}
    r = spied.post("/v1/completions", content=BODY, headers=headers)
    assert r.status_code == 415 and r.headers["connection"] == "close", r.text
    error = r.json()["error"]
    assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]
    assert (content_type or "no Content-Type") in error["message"]
    assert counters.submitted == submitted and counters.refused["unsupported_media_type"] == refused + 1


@pytest.mark.parametrize("content_type", ["application/json", "Application/JSON; charset=utf-8"])
def test_a_json_body_is_served(spied, content_type):
    r = spied.post("/v1/completions", content=BODY, headers={"content-type": content_type})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "localhost.evil.example", "127.0.0.2",
                                  "[::2]:8000", "0.0.0.0"])
def test_a_host_that_is_not_the_servers_gets_400_on_every_route(spied, host):
    for method, path in (("GET", "/health"), ("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions")):
        r = spied.call(spied.client.request(method, path, content=BODY if method == "POST" else None,
                                            headers={"host": host, "content-type": "application/json"}))
        assert r.status_code == 400, (host, path, r.text)
        error = r.json()["error"]
        assert error["code"] == "host_not_allowed" and "--allowed-hosts" in error["message"]
        assert host in error["message"]


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:8000", "127.0.0.1:9", "[::1]:8000", "[0:0::1]", "localhost."])
def test_localhost_names_are_served(spied, host):
    r = spied.call(spied.client.get("/health", headers={"host": host}))
    assert r.status_code == 200, (host, r.text)


def test_allowed_hosts_replace_the_defaults_and_star_allows_any(tiny_served):
    app = live_app(*tiny_served, allowed_hosts=["api.example.com", ".corp.example"])
    try:
        for host, status in (("api.example.com:443", 200), ("corp.example", 200), ("gpu1.corp.example", 200),
                             ("localhost", 400), ("evilcorp.example", 400)):
            assert app.call(app.client.get("/health", headers={"host": host})).status_code == status, host
    finally:
        app.close()
    app = live_app(*tiny_served, allowed_hosts=["*"])
    try:
        assert app.call(app.client.get("/health", headers={"host": "anything.example"})).status_code == 200
    finally:
        app.close()


def test_host_names_are_compared_as_names():
    assert normalize_host("Example.COM:8000") == "example.com"
    assert normalize_host("[::1]:8000") == normalize_host("::1") == normalize_host("0:0:0:0:0:0:0:1") == "::1"
    assert normalize_host("localhost.") == "localhost" and normalize_host("127.0.0.1:80") == "127.0.0.1"
    assert host_allowed("[0::1]", ["::1"]) and not host_allowed("[::2]", ["::1"])
    assert host_allowed("a.b.example", [".example"]) and not host_allowed("badexample", [".example"])


def test_default_hosts_are_localhost_and_the_bind_address():
    assert default_allowed_hosts("127.0.0.1") == list(LOCAL_HOSTS)
    assert default_allowed_hosts("192.168.5.7") == [*LOCAL_HOSTS, "192.168.5.7"]
    wildcard = default_allowed_hosts("0.0.0.0")
    assert wildcard[:3] == list(LOCAL_HOSTS) and "0.0.0.0" not in wildcard and len(wildcard) > 3
