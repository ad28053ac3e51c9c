"""The session's real vLLM server, keyed like `sluice up`'s, refuses every request without
its key: vLLM's ``/v1`` routes and the dev-mode ones (``/collective_rpc``: load any
weights) alike; only ``/health`` answers (docs/security.md: vLLM servers)."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from tests.vllm.conftest import VLLMServer

# (method, path, JSON body): generation, and the dev-mode routes sluice's swaps use
GUARDED = [("GET", "/v1/models", None),
           ("POST", "/v1/completions", b'{"model": "m", "prompt": [1], "max_tokens": 1}'),
           ("POST", "/tokenize", b'{"prompt": "hi"}'),
           ("POST", "/collective_rpc", b'{"method": "reload_weights"}'),
           ("POST", "/pause", None), ("GET", "/is_paused", None),
           ("GET", "/weight_info", None), ("GET", "/metrics", None)]


def status(url: str, method: str, body: bytes | None, headers: dict[str, str]) -> int:
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


@pytest.mark.parametrize("method,path,body", GUARDED)
def test_requests_without_the_key_get_401(vllm_server: VLLMServer, method: str, path: str,
                                          body: bytes | None) -> None:
    url = vllm_server.url + path
    assert status(url, method, body, {}) == 401
    assert status(url, method, body, {"Authorization": "Bearer not-the-key"}) == 401


def test_health_is_open_and_the_key_is_accepted(vllm_server: VLLMServer) -> None:
    assert status(vllm_server.url + "/health", "GET", None, {}) == 200
    assert status(vllm_server.url + "/is_paused", "GET", None, vllm_server.headers) == 200
    assert status(vllm_server.url + "/v1/models", "GET", None, vllm_server.headers) == 200


def test_the_key_is_not_on_the_servers_command_line(vllm_server: VLLMServer) -> None:
    assert vllm_server.local.proc is not None
    cmdline = open(f"/proc/{vllm_server.local.proc.pid}/cmdline", "rb").read()
    assert vllm_server.api_key.encode() not in cmdline
