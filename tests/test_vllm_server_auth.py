"""`grpokit vllm-serve` is not open to the network by default: it listens on the loopback unless --host says
otherwise, and with a shared token (--token or GRPOKIT_VLLM_TOKEN) it refuses every POST (generation, weight
updates) that does not carry it. The HTTP layer is tested here with a stand-in for the vLLM engine (vLLM itself is
not in the default environment); tests/test_vllm_server.py runs the real server with a token in the vLLM one."""

import json
import threading
import urllib.error
import urllib.request
from http.server import HTTPServer

import pytest

from grpokit.rollout.vllm_client import auth_headers
from grpokit.vllm_server import arguments, handler_for


class Service:
    """What the handler calls: the served model's description and a generate that records what reached it."""

    info = {"instance": "one"}

    def __init__(self):
        self.generated = []

    def health(self):
        return {"status": "ok"}

    def describe(self):
        return {"model_type": "qwen2", **self.info}

    def generate(self, request):
        self.generated.append(request)
        return {"completions": []}

    def update_weights(self, body):
        raise AssertionError("no weights may reach the engine in this test")


@pytest.fixture
def served():
    service = Service()
    server = HTTPServer(("127.0.0.1", 0), handler_for(service, token="s3cret"))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", service
    server.shutdown()


def call(url: str, path: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url + path, data=body, headers=headers or {}, method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_without_the_token_generation_and_weight_updates_are_refused(served):
    url, service = served
    generate = json.dumps({"instance": "one", "prompt_ids": [[1]]}).encode()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        status, answer = call(url, "/generate", generate, headers)
        assert status == 401 and "GRPOKIT_VLLM_TOKEN" in answer["error"]["message"]
        assert answer["error"]["type"] == "authentication_error"
        assert call(url, "/update_weights", b"weights", headers)[0] == 401
    assert service.generated == []
    status, _ = call(url, "/generate", generate, {"Authorization": "Bearer s3cret"})
    assert status == 200 and len(service.generated) == 1
    assert call(url, "/health") == (200, {"status": "ok"})  # no weights, no samples: open


def test_the_trainer_sends_the_token_of_its_environment(served, monkeypatch):
    url, _service = served
    monkeypatch.setenv("GRPOKIT_VLLM_TOKEN", "s3cret")
    assert call(url, "/generate", json.dumps({"instance": "one"}).encode(), auth_headers())[0] == 200
    monkeypatch.delenv("GRPOKIT_VLLM_TOKEN")
    assert auth_headers() == {}


def test_the_server_listens_on_the_loopback_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("GRPOKIT_VLLM_TOKEN", raising=False)
    options = arguments().parse_args(["--model", "DIR"])
    assert options.host == "127.0.0.1" and options.token is None
    monkeypatch.setenv("GRPOKIT_VLLM_TOKEN", "from-env")
    assert arguments().parse_args(["--model", "DIR", "--host", "0.0.0.0"]).token == "from-env"


def test_both_servers_answer_errors_in_one_format():
    """`grpokit vllm-serve` and the agent endpoint share one JSON handler (grpokit.json_http): a refusal and a
    server-side failure reach the client as OpenAI's {"error": {"message", "type", ...}}, and the vLLM client reads
    that format (a restart's instance, a failure's message)."""
    from grpokit.integrations.endpoint import PolicyEndpoint
    from grpokit.json_http import error_of
    from grpokit.testing import build_char_tokenizer

    service = Service()
    server = HTTPServer(("127.0.0.1", 0), handler_for(service))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = PolicyEndpoint(build_char_tokenizer(), max_completion_length=4).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        status, answer = call(url, "/nowhere", b"{}")
        assert status == 404 and set(answer) == {"error"} and answer["error"]["type"] == "invalid_request_error"
        status, answer = call(url, "/generate", json.dumps({"instance": "another"}).encode())
        assert status == 409 and error_of(answer)["instance"] == "one" and "restarted" in error_of(answer)["message"]
        status, answer = call(url, "/update_weights", b"weights")  # the stand-in engine raises
        assert status == 500 and error_of(answer)["type"] == "server_error"
        assert error_of(answer)["message"].startswith("AssertionError: no weights may reach the engine")
        status, answer = call(endpoint.url, "/nowhere", b"{}")
        assert status == 404 and set(answer) == {"error"} and answer["error"]["type"] == "invalid_request_error"
        assert set(answer["error"]) == {"message", "type"}
    finally:
        server.shutdown()
        endpoint.stop()
