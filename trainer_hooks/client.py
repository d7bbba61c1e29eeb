"""`SidecarClient`: the HTTP API from Python, with typed errors, timeouts and safe retries.

- Every call has a timeout (the client's default, or the call's `timeout=`); generation and weight
  updates default to the longer `long_timeout` because the server answers only when they are done.
- A plain-http sidecar is reached over kept-alive http.client connections (trainer_hooks/client_http.py:
  httpx's per-request Python was most of a control message's cost); https, a proxy from the environment,
  or a caller's `transport` go through httpx.
- Only idempotent calls (GET: health, state, checksums, metrics) are retried, on connection errors
  and timeouts, with exponential backoff. generate, completions, sleep, wake_up and every weight
  call are sent once: a retry could run them twice.
- An error response raises a subclass of SidecarHTTPError carrying `status`, `type`, `field`,
  `message` and `rank` from the server's {"error": {...}} body; 400/422 errors are also
  InvalidRequestError and 409 errors StateError (inference.core), so callers can catch those; a
  failed per-rank audit at finish is SidecarChecksumError. The classes live in
  trainer_hooks/client_errors.py (no httpx), so the hook catches them without importing httpx.
- The JSON shapes of the bodies (sampling params, digest records, finish's compact digests, the
  RequestOutputs of /generate) are built and read in trainer_hooks/client_codec.py; `records_json` and
  `finish_digests` are re-exported here.

It lives with the trainer's side (the hook drives it); sidecar.client and `from sidecar import
SidecarClient` re-export it.

`sync_weights(sender, named_tensors, version)` runs one sync in ONE request: POST /weights/update carrying
the start and "finish", written before `sender.send()` starts (its answer awaited in a background thread
while send() moves the bytes). send() then delivers the sender's digests to the ranks over the transfer
group (inference/transfer/delivery.py), every rank compares them with what it holds and commits, and the
update's answer is the audit. A start the sidecar refuses makes the ranks refuse the sender's plan
agreement, so send() fails at once and the sidecar's error is raised. Older sidecars get older paths, by
what /weights/init answered: without `audit_in_update`, update carrying the start -> finish(digests), sent
as soon as send() returns (whose answer carries the audit); without `start_in_update` either (or a sender
joined through another client), a separate start first. The start stays small: after the first sync of
a layout it names the layout by key instead of listing every tensor (the sidecar answers an unknown key
with a 400 on `manifest.layout`, and the client sends the tensors again).
"""

from __future__ import annotations

import http.client
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from inference.core import RequestOutput, SamplingParams, SidecarError
from trainer_hooks.client_codec import finish_digests, manifest_layout, params_dict, records_json, request_output
from trainer_hooks.client_errors import (
    SidecarAuthError,
    SidecarBusyError,
    SidecarChecksumError,
    SidecarConnectionError,
    SidecarHTTPError,
    SidecarMemoryError,
    SidecarNotFoundError,
    SidecarRequestError,
    SidecarServerError,
    SidecarStateError,
    SidecarTransferError,
    SidecarUnavailableError,
    error_class,
)
from trainer_hooks.client_http import KeepAliveWire, ReadOnce, join_both, lean_wire_applies

_TRANSPORT_ERRORS = (httpx.TransportError, OSError, http.client.HTTPException)  # the request or its answer is lost
LAYOUT_FIELD = "manifest.layout"  # the field of the sidecar's 400 for a layout key it does not know

__all__ = [
    "SidecarAuthError",
    "SidecarBusyError",
    "SidecarChecksumError",
    "SidecarClient",
    "SidecarConnectionError",
    "SidecarHTTPError",
    "SidecarMemoryError",
    "SidecarNotFoundError",
    "SidecarRequestError",
    "SidecarServerError",
    "SidecarStateError",
    "SidecarTransferError",
    "SidecarUnavailableError",
    "error_from_response",
    "records_json",
]


def error_from_response(resp: httpx.Response) -> SidecarHTTPError:
    try:
        body = resp.json()
    except ValueError:
        body = None
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        err = {"type": resp.reason_phrase or "HTTPError", "message": resp.text[:500]}
    cls = error_class(resp.status_code, str(err.get("type")))
    return cls(resp.status_code, str(err.get("type")), str(err.get("message")), err.get("field"), err.get("rank"), body)


class SidecarClient:
    def __init__(self, url: str, api_key: str | None = None, timeout: float = 30.0, *,
                 long_timeout: float = 900.0, retries: int = 3, backoff_s: float = 0.25,
                 transport: httpx.BaseTransport | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url.rstrip("/")
        self.timeout, self.long_timeout, self.retries, self.backoff_s = timeout, long_timeout, retries, backoff_s
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, transport=transport)
        # Plain http to a sidecar (no proxy, no caller's transport): the lean kept-alive wire, ~0.35 ms less
        # Python per control message than httpx (trainer_hooks/client_http.py says why).
        self._wire = KeepAliveWire(self.url, headers) if transport is None and lean_wire_applies(self.url) else None
        self._layouts: set[str] = set()  # manifest layouts this sidecar has parsed (start_weights)
        self._start_in_update = False  # the sidecar's /weights/init said /weights/update takes a "start"
        self._audit_in_update = False  # ... and "finish", with the digests the sender delivers in the sync
        self._update_pool = ThreadPoolExecutor(1, thread_name_prefix="sidecar-update")  # update beside send

    def close(self) -> None:
        self._http.close()
        if self._wire is not None:
            self._wire.close()
        self._update_pool.shutdown(wait=True)

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- transport ----------------------------------------------------------------------------
    def _request(self, method: str, path: str, *, json: Any = None, params: dict[str, Any] | None = None,
                 timeout: float | None = None, ok_statuses: tuple[int, ...] = ()) -> httpx.Response:
        """The checked httpx.Response of one call (every request but a deferred one passes here)."""
        idempotent = method == "GET"
        attempts = 1 + (self.retries if idempotent else 0)
        for attempt in range(attempts):
            try:
                resp = self._send_later(method, path, json, params, timeout)()
            except _TRANSPORT_ERRORS as e:
                if attempt + 1 < attempts:
                    time.sleep(self.backoff_s * 2**attempt)
                    continue
                raise self._gone(method, path, e) from e
            return _checked(resp, ok_statuses)
        raise AssertionError("unreachable")

    def _send_later(self, method: str, path: str, json: Any, params: dict[str, Any] | None,
                    timeout: float | None) -> Callable[[], httpx.Response]:
        """Write the request now when the lean wire carries it (httpx writes when the callable runs); the
        callable returns the answer. Raises what the transport raises (_TRANSPORT_ERRORS)."""
        t = timeout if timeout is not None else self.timeout
        if self._wire is not None:
            return self._wire.begin(method, path, json=json, params=params, timeout=t)
        return lambda: self._http.request(method, path, json=json, params=params, timeout=t)

    def _deferred(self, method: str, path: str, json: Any, timeout: float | None) -> Callable[[], httpx.Response]:
        """A call sent once, never retried (not a GET): the request is written now, and the returned
        callable reads its checked answer."""
        assert method != "GET", "a deferred call is sent once; GETs are retried"
        try:
            read = self._send_later(method, path, json, None, timeout)
        except _TRANSPORT_ERRORS as e:
            raise self._gone(method, path, e) from e

        def answer() -> httpx.Response:
            try:
                resp = read()
            except _TRANSPORT_ERRORS as e:
                raise self._gone(method, path, e) from e
            return _checked(resp, ())

        return answer

    def _gone(self, method: str, path: str, e: BaseException) -> SidecarConnectionError:
        return SidecarConnectionError(f"{method} {self.url}{path}: {type(e).__name__}: {e}")

    def _get(self, path: str, **kw: Any) -> Any:
        return self._request("GET", path, **kw).json()

    def _post(self, path: str, body: Any = None, *, timeout: float | None = None) -> Any:
        return self._request("POST", path, json=body if body is not None else {}, timeout=timeout).json()

    # ---- reads --------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """{"status": "ok"} or {"status": "unhealthy", "error": ...} (a 503 is an answer, not an error)."""
        return self._request("GET", "/health", ok_statuses=(503,)).json()

    def is_healthy(self) -> bool:
        try:
            return self.health().get("status") == "ok"
        except SidecarError:
            return False

    def state(self) -> dict[str, Any]:
        return self._get("/state")

    def checksums(self, model: str = "target", source: str = "held",
                  algorithm: str | None = None) -> list[dict[str, Any]]:
        """Every rank's manifest (checksum.Manifest.from_dict reads each). `algorithm`: the digest rule of
        "held" (default: the rank's, the device rule on a GPU)."""
        params = {"model": model, "source": source, **({"algorithm": algorithm} if algorithm else {})}
        return self._get("/checksums", params=params, timeout=self.long_timeout)["manifests"]

    def metrics(self) -> str:
        return self._request("GET", "/metrics").text

    # ---- generation ---------------------------------------------------------------------------
    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Mapping[str, Any] | Sequence[Any] | None = None, *,
                 wait: bool = True, timeout: float | None = None) -> list[RequestOutput]:
        """RequestOutputs in prompt order (token ids, logprobs, text, weight version)."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        body: dict[str, Any] = {"prompts": [p if isinstance(p, str) else list(p) for p in prompts], "wait": wait}
        if sampling_params is not None:
            body["sampling_params"] = ([params_dict(p) for p in sampling_params]
                                       if isinstance(sampling_params, Sequence) else params_dict(sampling_params))
        data = self._post("/generate", body, timeout=timeout or self.long_timeout)
        return [request_output(i, o) for i, o in enumerate(data["outputs"])]

    def completions(self, prompt: Any, *, timeout: float | None = None, **fields: Any) -> dict[str, Any]:
        """POST /v1/completions with OpenAI fields (model, max_tokens, temperature, n, stop, seed, ...)."""
        return self._post("/v1/completions", {"prompt": prompt, **fields}, timeout=timeout or self.long_timeout)

    # ---- control ------------------------------------------------------------------------------
    def sleep(self, level: int = 1, in_flight: str = "finish", *, timeout: float | None = None) -> dict[str, Any]:
        return self._post("/sleep", {"level": level, "in_flight": in_flight}, timeout=timeout or self.long_timeout)

    def wake_up(self, tags: list[str] | None = None, *, timeout: float | None = None) -> dict[str, Any]:
        return self._post("/wake_up", {"tags": tags}, timeout=timeout or self.long_timeout)

    def pause(self) -> dict[str, Any]:
        return self._post("/pause")

    def resume(self) -> dict[str, Any]:
        return self._post("/resume")

    def init_weights(self, init_info: Mapping[str, Any], *, timeout: float | None = None) -> dict[str, Any]:
        return self._post("/weights/init", {"init_info": dict(init_info)}, timeout=timeout or self.long_timeout)

    def start_weights(self, version: int, manifest: Any, *, model: str = "target", allow_cast: bool = False,
                      timeout: float | None = None) -> dict[str, Any]:
        """Open a session. A manifest naming a "layout" this sidecar parsed before travels as that key
        alone (see the module docstring)."""
        body = self._start_body(version, manifest, model, allow_cast, short=True)
        try:
            reply = self._post("/weights/start", body, timeout=timeout or self.long_timeout)
        except SidecarRequestError as e:
            if body["manifest"] is manifest or e.field != LAYOUT_FIELD:
                raise
            self._layouts.discard(manifest["layout"])  # e.g. a restarted sidecar: send the tensors
            body = self._start_body(version, manifest, model, allow_cast, short=False)
            reply = self._post("/weights/start", body, timeout=timeout or self.long_timeout)
        self._parsed(manifest)
        return reply

    def update_weights(self, update_info: Any = None, *, start: Mapping[str, Any] | None = None,
                       finish: bool = False, timeout: float | None = None) -> dict[str, Any]:
        """POST /weights/update. `start`: a /weights/start body, to open the session in this same call (a
        sidecar whose init answer has "start_in_update"); run the sender's send() beside it. `finish`: the
        sender delivers its digests in the sync (send(deliver_digests=True)), so the ranks audit and commit
        in this call and its answer is finish's (a sidecar whose init answer has "audit_in_update")."""
        return self._update_later(update_info, start=start, finish=finish, timeout=timeout)()

    def _update_later(self, update_info: Any = None, *, start: Mapping[str, Any] | None = None,
                      finish: bool = False, timeout: float | None = None) -> Callable[[], dict[str, Any]]:
        """update_weights written now, its answer read by the returned callable (sync_weights reads it in
        the update thread, while send() runs here)."""
        body = {"update_info": update_info, **({"start": dict(start)} if start is not None else {}),
                **({"finish": True} if finish else {})}
        read = self._deferred("POST", "/weights/update", body, timeout or self.long_timeout)
        return lambda: read().json()

    def finish_weights(self, digests: Any, *, timeout: float | None = None) -> dict[str, Any]:
        return self._post("/weights/finish", {"digests": records_json(digests)}, timeout=timeout or self.long_timeout)

    def abort_weights(self, *, timeout: float | None = None) -> dict[str, Any]:
        """POST /weights/abort: end the open update session now ({"aborted": whether one was open})."""
        return self._post("/weights/abort", timeout=timeout or self.long_timeout)

    def audit(self, model: str = "target", source: str = "held", expected: Any = None, *,
              algorithm: str | None = None, timeout: float | None = None) -> dict[str, Any]:
        """POST /audit. `algorithm`: the rule of "held" digests (default: the one `expected` manifests
        name, else the rank's)."""
        body = {"model": model, "source": source,
                "expected": records_json(expected) if expected is not None else None}
        params = {"algorithm": algorithm} if algorithm else None
        return self._request("POST", "/audit", json=body, params=params,
                             timeout=timeout or self.long_timeout).json()

    # ---- a whole sync with inference.transfer.sender.WeightSender -----------------------------------
    def connect_sender(self, sender: Any) -> dict[str, Any]:
        """Join sender and sidecar: POST /weights/init in a thread while sender.connect() blocks. When the
        sidecar refuses the init (a 400 naming the field, a 409, a dead rank) the sender's wait for
        receivers is called off at once and that error is raised, not a join timeout minutes later."""
        info = sender.init_info()
        with ThreadPoolExecutor(1, thread_name_prefix="sidecar-init") as pool:
            fut = pool.submit(self.init_weights, info)

            def refused(done: Any) -> None:
                if done.exception() is not None:
                    sender.call_off_connect(f"the sidecar refused the init: {done.exception()}")

            fut.add_done_callback(refused)
            join_both(fut, sender.connect)
            reply = fut.result()
        self._start_in_update = reply.get("start_in_update") is True
        self._audit_in_update = self._start_in_update and reply.get("audit_in_update") is True
        return reply

    def sync_weights(self, sender: Any, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
                     version: int, model: str = "target", *, allow_cast: bool = False) -> dict[str, Any]:
        """ONE request: update carrying the start and "finish" (HTTP, background thread) while sender.send()
        moves the bytes and then delivers its digests to the ranks, which audit and commit before answering
        (a sidecar without audit_in_update: update, then finish(digests); without start_in_update: start
        first; an older one still: a separate audit after finish).

        Returns the audit of what every rank received against the sender's digests (its "ok" is
        True on success; a mismatch raises SidecarChecksumError naming tensor and rank).
        """
        named = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        if not getattr(sender, "connected", True):
            self.connect_sender(sender)
        manifest = sender.manifest(named, version)
        if self._audit_in_update:
            update, _ = self._start_and_send(sender, named, manifest, version, model, allow_cast, finish=True)
            return update.result()["audit"]
        if self._start_in_update:
            update, records = self._start_and_send(sender, named, manifest, version, model, allow_cast)
            # send() returned, so every rank holds the bytes and runs finish after this update: send finish now,
            # while the update's answer is still on its way (its error, the cause, wins).
            finish = join_both(update, lambda: self.finish_weights(finish_digests(manifest, records)))
        else:
            self.start_weights(version, manifest, model=model, allow_cast=allow_cast)
            update = self._update_pool.submit(self.update_weights)
            records = join_both(update, lambda: sender.send(named))
            finish = self.finish_weights(finish_digests(manifest, records))
        if "audit" in finish:  # every rank's passing comparison with these digests: the audit itself
            return finish["audit"]
        return self.audit(model=model, source="received", expected=records_json(records))  # an older sidecar

    def _start_and_send(self, sender: Any, named: list[tuple[str, Any]], manifest: Any, version: int, model: str,
                        allow_cast: bool, *, finish: bool = False) -> tuple[Any, Any]:
        """An update carrying the start, written before sender.send() runs here: (the update's answer as a
        future's `result()`; the sender's records). send() returning means every rank started and
        received (with `finish`: and has the sender's digests, so the update's answer is the audit). A
        layout key the sidecar does not know (400 on manifest.layout; the ranks refused the send) is sent
        again with the tensors."""
        for short in (True, False):
            start = self._start_body(version, manifest, model, allow_cast, short=short)
            # The lean wire writes it here, before send() starts. With finish nothing else is sent in this sync,
            # so this thread reads the answer once send() returned (no thread hop on the critical path); else
            # the pool thread waits for it while finish goes out, or writes it (httpx writes when it reads).
            later = self._update_later(start=start, finish=finish)
            update: Any = ReadOnce(later) if finish and self._wire is not None else self._update_pool.submit(later)
            try:
                records = sender.send(named, deliver_digests=True) if finish else sender.send(named)
            except BaseException:
                try:
                    update.result()
                except SidecarRequestError as e:
                    if start["manifest"] is manifest or e.field != LAYOUT_FIELD:
                        raise e from None
                    self._layouts.discard(manifest["layout"])  # e.g. a restarted sidecar: send the tensors
                    manifest = sender.manifest(named, version)  # arm the sender again for the second send()
                    continue
                except SidecarError as remote:
                    raise remote from None  # the sidecar's error names the field and the rank
                raise
            self._parsed(manifest)
            return update, records
        raise AssertionError("unreachable: the full manifest is never answered on manifest.layout")

    def _start_body(self, version: int, manifest: Any, model: str, allow_cast: bool, *, short: bool) -> dict[str, Any]:
        """The /weights/start body; with `short`, a manifest whose layout this sidecar parsed travels as that
        key alone (the same dict otherwise: callers test `body["manifest"] is manifest`)."""
        layout = manifest_layout(manifest)
        if short and layout is not None and layout in self._layouts:
            manifest = {k: v for k, v in manifest.items() if k != "tensors"}
        return {"model": model, "version": version, "manifest": manifest, "allow_cast": allow_cast}

    def _parsed(self, manifest: Any) -> None:
        """The sidecar accepted `manifest`: its layout may travel as the key from now on."""
        layout = manifest_layout(manifest)
        if layout is not None:
            self._layouts.add(layout)


def _checked(resp: httpx.Response, ok_statuses: tuple[int, ...]) -> httpx.Response:
    if resp.is_error and resp.status_code not in ok_statuses:
        raise error_from_response(resp)
    return resp
