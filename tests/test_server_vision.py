"""Pictures over HTTP: ``image_url`` parts (data URLs, http(s) from allowed hosts) through ``fdplug serve``
and the official ``openai`` client, on the tiny Qwen2.5-VL and ERNIE-4.5-VL of tests/fixtures/vision
(transformers' greedy tokens), streamed and not; bad pictures as OpenAI error objects naming the item."""

from __future__ import annotations

import base64
import http.server
import threading

import openai
import pytest

from tests.serverkit import Server
from tests.test_vision_language import GREEDY, MODELS, QWEN, Fixture

# the chat template that spells golden case 0's prompt exactly (no default system message)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{{ '<|im_start|>assistant\\n' }}")   # (jinja drops a template's own trailing newline)


@pytest.fixture(scope="module")
def pictures_host():
    """A loopback http server holding image_a.png (and nothing at any other path)."""
    body = QWEN.picture_bytes("image_a")   # (the same file in both fixtures)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):   # noqa: N802 (the stdlib's name)
            if self.path != "/a.png":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module", params=MODELS)
def server(request, tmp_path_factory, pictures_host):
    fixture = Fixture(request.param)
    srv = Server(["--model", str(fixture.dir), "--served-model-name", "vl", "--max-model-len", "256",
                  "--num-kv-blocks", "64", "--trust-request-chat-template"],
                 tmp_path_factory.mktemp("serve") / "vl.log", FDPLUG_ALLOWED_FEATURE_HOSTS=pictures_host).wait_ready()
    srv.fixture = fixture
    yield srv
    assert srv.stop() == 0, srv.log()


def messages(picture: dict) -> list[dict]:
    return [{"role": "user", "content": [picture, {"type": "text", "text": "Describe the picture."}]}]


def data_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def ask(server, picture: dict, stream: bool = False) -> str:
    kwargs = dict(model="vl", messages=messages(picture), temperature=0, max_tokens=12,
                  extra_body={"ignore_eos": True, "chat_template": TEMPLATE})
    client = server.openai()
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content
    return "".join(chunk.choices[0].delta.content or "" for chunk in
                   client.chat.completions.create(stream=True, **kwargs) if chunk.choices)


def test_image_url_answers_with_transformers_tokens(server, pictures_host):
    fx = server.fixture
    offline = fx.make_llm()
    out = offline.chat(messages(data_part(fx.picture_bytes("image_a"))), GREEDY, use_tqdm=False,
                       chat_template=TEMPLATE)[0]
    assert out.prompt_token_ids == fx.cases[0]["prompt"] and out.outputs[0].token_ids == fx.cases[0]["greedy"]
    want = out.outputs[0].text
    assert ask(server, data_part(fx.picture_bytes("image_a"))) == want
    assert ask(server, data_part(fx.picture_bytes("image_a")), stream=True) == want
    url = {"type": "image_url", "image_url": {"url": f"http://{pictures_host}/a.png"}}
    assert ask(server, url) == want


@pytest.mark.parametrize("picture, words", [
    (data_part(b"GIF89a but not really"), "image_url item 0 (message 0) is not a readable image"),
    ({"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/a.png"}}, "127.0.0.1:9"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,%%"}}, "base64 is malformed"),
    ({"type": "image_url", "image_url": {"url": "http://PLACEHOLDER/missing.png"}}, "missing.png"),
])
def test_bad_pictures_are_openai_errors(server, pictures_host, picture, words):
    if "PLACEHOLDER" in picture["image_url"]["url"]:
        picture = {"type": "image_url", "image_url": {"url": f"http://{pictures_host}/missing.png"}}
    with pytest.raises(openai.APIStatusError) as err:
        ask(server, picture)
    assert 400 <= err.value.status_code < 500, err.value.body
    assert words in err.value.body["message"]
