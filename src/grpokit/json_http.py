"""The JSON-over-HTTP handler of grpokit's two servers, the agent endpoint (`integrations.endpoint`) and
`grpokit vllm-serve` (`vllm_server`): a route returns a dict, answered as JSON with status 200; a route that refuses
raises `JSONError`, and any other exception becomes a 500, so that a client gets the server's reason rather than a
dropped connection. Errors have one format, OpenAI's (the endpoint's clients are OpenAI SDKs):

    {"error": {"message": "...", "type": "invalid_request_error" | "server_error" | ..., <extra fields>}}

Each server keeps its own threading: the endpoint serves a generation's sessions at once (`ThreadingHTTPServer`,
keep-alive); the vLLM server answers one request at a time (`HTTPServer`), as its engine takes one call at a time.
"""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler


class JSONError(Exception):
    """A route's refusal: the HTTP status, the message, OpenAI's error type and any extra fields for the client."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", **fields):
        super().__init__(message)
        self.status, self.kind, self.fields = status, kind, fields

    def payload(self) -> dict:
        return error_payload(str(self), self.kind, **self.fields)


def error_payload(message: str, kind: str, **fields) -> dict:
    return {"error": {"message": message, "type": kind, **fields}}


def error_of(answer: dict) -> dict:
    """The `error` object of an error answer ({} when it has none)."""
    error = answer.get("error") if isinstance(answer, dict) else None
    return error if isinstance(error, dict) else {}


class JSONHandler(BaseHTTPRequestHandler):
    """Subclasses implement `route(method, path) -> dict`, reading the request's body with `body()` or
    `json_body()`."""

    def route(self, method: str, path: str) -> dict:
        raise JSONError(404, f"No route {method} {path}.")

    _body: bytes | None = None  # this request's body, once read (a keep-alive connection's handler serves many)

    def body(self) -> bytes:
        if self._body is None:
            self._body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        return self._body

    def json_body(self) -> dict:
        return json.loads(self.body() or b"{}")

    def reply(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _answer(self, method: str) -> None:
        self._body = None
        try:
            status, payload = 200, self.route(method, self.path)
        except JSONError as error:
            status, payload = error.status, error.payload()
        except Exception as error:
            status, payload = 500, error_payload(f"{type(error).__name__}: {error}", "server_error")
        if status != 200:
            self.body()  # an unread body would reach the client as a reset connection, not this answer
        self.reply(status, payload)

    def do_GET(self):
        self._answer("GET")

    def do_POST(self):
        self._answer("POST")

    def log_message(self, format, *args):  # one line per request is noise at RL request rates
        pass
