"""Who may call the server and how much one request may send: two ASGI middlewares in front of the routes.

``RequireApiKey`` refuses every request under ``/v1`` without ``Authorization: Bearer <key>`` (401), as vLLM's
``--api-key`` does; ``/health`` stays open so that a load balancer can probe it. It runs before the body is read,
so a caller without the key learns nothing about what a valid body looks like. ``LimitRequestBody`` answers 413 to
a body over ``max_request_bytes``, by its Content-Length header or, for a chunked body, as soon as the bytes read
pass the limit, so a client cannot make the server buffer an unbounded body.
"""

from __future__ import annotations

import json
import secrets

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


def error_json(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


async def send_json(send: Send, status: int, body: dict, headers: list[tuple[bytes, bytes]] = ()) -> None:
    payload = json.dumps(body).encode()
    start_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": start_headers + list(headers)})
    await send({"type": "http.response.body", "body": payload})


class RequireApiKey:
    """401 for a request under ``/v1`` whose ``Authorization`` header is not ``Bearer <api_key>``."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):  # constant time: no timing hint about the key
                message = "missing or incorrect API key: send the header 'Authorization: Bearer <key>'"
                body = error_json(message, "invalid_request_error", code="invalid_api_key")
                await send_json(send, 401, body, [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)


class LimitRequestBody:
    """413 for a request body over ``max_request_bytes``."""

    def __init__(self, app: ASGIApp, max_request_bytes: int) -> None:
        self.app = app
        self.max_request_bytes = max_request_bytes

    def _too_large(self) -> str:
        return f"the request body is over the server's limit of {self.max_request_bytes} bytes (--max-request-bytes)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_request_bytes:
            await send_json(send, 413, error_json(self._too_large(), "invalid_request_error", code="request_too_large"))
            return
        received_bytes = 0

        async def limited_receive() -> Message:
            nonlocal received_bytes
            message = await receive()
            if message["type"] == "http.request":
                received_bytes += len(message.get("body", b""))
                if received_bytes > self.max_request_bytes:
                    # FastAPI re-raises an HTTPException from reading the body; the app's handler formats it.
                    raise HTTPException(413, self._too_large())
            return message

        await self.app(scope, limited_receive, send)
