"""A small client for OpenAI-compatible HTTP endpoints (vLLM, SGLang, TGI, hosted APIs, `r1 serve`).

One JSON request at a time over the standard library's urllib, sorting failures into the two kinds a caller treats
differently: `Retryable` (connection refused or reset, a timeout, HTTP 5xx or 429: may pass on another try or on
another endpoint) and `EndpointError` (a refusal that will not pass: 4xx, a reply outside the OpenAI schema).
The API key is read from an environment variable whose NAME the config holds, and lives only in a request header:
never in a config, a log line or an error message.

Used by the HTTP judge (`judge.HTTPJudge`) and the HTTP generation backend (`http_backend`).
Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
import urllib.error
import urllib.request


class EndpointError(RuntimeError):
    """An endpoint that cannot be used: unreachable, refusing requests, or answering outside the OpenAI schema."""


class Retryable(Exception):
    """A failure worth another try; `wait_s` is the server's Retry-After, if any.

    `refused` is True when nothing listens at the address at all (connection refused), which a pool of endpoints
    takes as the endpoint being gone rather than busy; `status` is the HTTP status of a 5xx or 429 reply.
    """

    def __init__(self, cause: str, wait_s: float | None = None, refused: bool = False, status: int | None = None,
                 timed_out: bool = False):
        super().__init__(cause)
        self.cause, self.wait_s, self.refused, self.status = cause, wait_s, refused, status
        self.timed_out = timed_out  # no reply within the endpoint's timeout


class OpenAIEndpoint:
    """One endpoint root (the part before /models, /completions, ...), its key and its timeout.

    `label` names the endpoint's role in messages ("judge", "generation endpoint"); `error` is the EndpointError
    subclass raised, so each caller keeps its own exception type.
    """

    def __init__(self, base_url: str, *, api_key_env: str, timeout_s: float, label: str = "endpoint",
                 error: type[EndpointError] = EndpointError):
        self.base_url, self.api_key_env, self.timeout_s = base_url.rstrip("/"), api_key_env, timeout_s
        self.label, self.error = label, error
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        self.tries = 0  # requests sent, each retry one more: what the endpoint was asked to answer
        self._tries_lock = threading.Lock()
        key = os.environ.get(api_key_env)
        if key:  # the key lives only in this header, never in the config or a message
            self._headers["Authorization"] = f"Bearer {key}"

    def request(self, method: str, path: str, payload: dict | None = None, *, retries: int = 0,
                backoff_s: float = 1.0) -> dict:
        """One JSON request, retried with exponential backoff on failures that may pass; the parsed JSON reply."""
        tries = retries + 1
        for attempt in range(tries):
            try:
                return self.send(method, path, payload)
            except Retryable as e:
                failure = e
            if attempt + 1 < tries:
                backoff = backoff_s * 2**attempt
                # a server's Retry-After wins over our schedule, within reason
                time.sleep(backoff if failure.wait_s is None else min(max(failure.wait_s, backoff), 60.0))
        error = self.error(f"could not reach {self.label} at {self.base_url}{path}: {failure.cause} after {tries} "
                           f"{'try' if tries == 1 else 'tries'}")
        error.transient = True  # the kind of failure that passes (a timeout, a reset, a 5xx or 429): not a refusal
        error.timed_out, error.refused = failure.timed_out, failure.refused
        raise error

    def send(self, method: str, path: str, payload: dict | None = None) -> dict:
        """One try: the parsed JSON reply, Retryable for a failure that may pass, else `self.error`."""
        url = f"{self.base_url}{path}"
        with self._tries_lock:
            self.tries += 1
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(url, data=data, headers=self._headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                raw = reply.read()
        except urllib.error.HTTPError as e:
            detail = error_detail(e.read())
            if e.code == 429 or e.code >= 500:
                retry_after = e.headers.get("Retry-After", "")
                wait = float(retry_after) if retry_after.replace(".", "", 1).isdigit() else None
                raise Retryable(f"HTTP {e.code} {detail}".rstrip(), wait, status=e.code) from None
            hint = f" (is the key in ${self.api_key_env}?)" if e.code in (401, 403) else ""
            message = f"{self.label} at {url} refused the request: HTTP {e.code} {detail}".rstrip()
            raise self.error(message + hint) from None
        except urllib.error.URLError as e:  # refused, unknown host, or a timeout while connecting
            raise Retryable(describe(e.reason, self.timeout_s), refused=isinstance(e.reason, ConnectionRefusedError),
                            timed_out=isinstance(e.reason, TimeoutError)) from None
        except (TimeoutError, ConnectionError) as e:  # a timeout or reset while reading the reply
            raise Retryable(describe(e, self.timeout_s), timed_out=isinstance(e, TimeoutError)) from None
        except http.client.HTTPException as e:  # the server went away mid-reply (IncompleteRead, a bad status line)
            raise Retryable(f"the reply was cut off ({type(e).__name__})") from None
        try:
            return json.loads(raw)
        except ValueError:
            message = f"{self.label} at {url} answered with something other than JSON: {raw[:200]!r}"
        error = self.error(message)
        error.transient = True  # this reply was garbage; the next may not be
        raise error

    def served_models(self, *, retries: int = 0, backoff_s: float = 1.0) -> list[dict]:
        """GET /models: the entries of `data` (each has at least `id`), `self.error` if the reply has none."""
        body = self.request("GET", "/models", retries=retries, backoff_s=backoff_s)
        entries = body.get("data") if isinstance(body, dict) else None
        if not isinstance(entries, list) or not all(isinstance(m, dict) and "id" in m for m in entries):
            raise self.error(f"{self.label} at {self.base_url}/models answered outside the OpenAI schema "
                             f"(expected data[].id): {str(body)[:200]}")
        return entries


def describe(reason, timeout_s: float) -> str:
    """A connection failure in a few words: 'connection refused', 'timed out after 60s', or the OS's own message."""
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, TimeoutError):
        return f"timed out after {timeout_s:g}s"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror.lower()
    return str(reason) or type(reason).__name__


def error_detail(raw: bytes) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}}), else the start of the body."""
    try:
        return str(json.loads(raw)["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return raw[:300].decode(errors="replace").strip()
