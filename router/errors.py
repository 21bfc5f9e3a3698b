"""OpenAI-style errors: one exception type, rendered as `{"error": {...}}` with the right status."""
from __future__ import annotations

import json

from aiohttp import web

_TYPES = {400: "BadRequestError", 404: "NotFoundError", 413: "BadRequestError",
          429: "RateLimitError", 499: "ClientClosedRequest", 500: "InternalServerError",
          501: "NotImplementedError", 502: "BadGatewayError", 503: "ServiceUnavailableError",
          504: "GatewayTimeoutError"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 err_type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type or _TYPES.get(status, "APIError")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param,
                          "code": self.status}}

    def response(self) -> web.Response:
        return web.Response(status=self.status, text=json.dumps(self.body()),
                            content_type="application/json", headers=self.headers)
