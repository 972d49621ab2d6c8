"""Fuzzing a service from its own /openapi.json with schemathesis (driven through
hypothesis directly: schemathesis's pytest plugin does not load on this pytest)."""

from __future__ import annotations

from collections.abc import Iterable

import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode


def fuzz(url: str, headers: dict[str, str], *, examples: int = 25,
         skip: Iterable[str] = ()) -> list[tuple[str, int]]:
    """Per POST operation, `examples` bodies drawn from its schema and `examples` that break
    it; each GET once. Every answer must be below 500 (within the timeout). Returns the
    (path, status) of every call."""
    spec = requests.get(f"{url}/openapi.json", timeout=10).json()
    skip = set(skip)
    calls: list[tuple[str, int]] = []
    for result in schemathesis.openapi.from_dict(spec).get_all_operations():
        operation = result.ok()
        if operation.path in skip:
            continue
        post = operation.method.upper() == "POST"
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)[:1 + post]:
            @settings(max_examples=examples if post else 1, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def call(case):
                response = case.call(base_url=url, headers=headers, timeout=60)
                calls.append((case.path, response.status_code))
                assert response.status_code < 500, (
                    f"{case.method} {case.path} {case.body!r:.300} -> "
                    f"{response.status_code} {response.text[:300]}")

            call()
    return calls


def assert_idle_connections_do_not_starve(url: str, path: str, body: dict,
                                          headers: dict[str, str], n: int = 200) -> None:
    """`n` half-sent requests held open to `url` do not hold up a real request to `path`
    (answered 200 within 10 s)."""
    import socket
    import time

    host, port = url.removeprefix("http://").split(":")
    idle = []
    try:
        for _ in range(n):
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{{"
                      .encode())
            idle.append(s)
        start = time.monotonic()
        r = requests.post(url + path, headers=headers, json=body, timeout=30)
        assert r.status_code == 200 and time.monotonic() - start < 10, r.text[:300]
    finally:
        for s in idle:
            s.close()
        time.sleep(0.5)  # the server sees them go before the test's loop stops


def oversized_status(url: str, path: str, headers: dict[str, str], mib: int) -> int:
    """The status of a `mib` MiB JSON body posted to `path`."""
    body = b'{"prompt": "' + b"x" * (mib << 20) + b'"}'
    return requests.post(url + path, data=body, timeout=60,
                         headers=headers | {"Content-Type": "application/json"}).status_code
