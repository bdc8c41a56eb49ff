"""file:// under allowed roots only; http(s):// from allowed hosts only, size- and time-limited."""

from __future__ import annotations

import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from fdplug.core.config import EngineConfig
from fdplug.errors import (
    FeatureAccessDeniedError,
    FeatureNotFoundError,
    StorageTimeoutError,
)
from fdplug.plugins.storage_fs import make_file_storage, make_http_storage
from fdplug.plugins.storage_fs.file_storage import FileStorage
from fdplug.plugins.storage_fs.http_storage import HttpStorage

# ---------------------------------------------------------------------------------------------------
# file://
# ---------------------------------------------------------------------------------------------------


@pytest.fixture
def tree(tmp_path):
    """root/ (allowed) with a feature, a symlink out and a symlink in; secret.npy and root2/ beside it."""
    root, root2 = tmp_path / "root", tmp_path / "root2"
    (root / "sub").mkdir(parents=True)
    root2.mkdir()
    np.save(root / "sub" / "good.npy", np.ones((2, 4), np.float32))
    np.save(tmp_path / "secret.npy", np.zeros((1, 1), np.float32))
    np.save(root2 / "near.npy", np.zeros((1, 1), np.float32))
    os.symlink(tmp_path / "secret.npy", root / "link_out.npy")
    os.symlink(root / "sub" / "good.npy", root / "link_in.npy")
    return tmp_path


def test_a_file_under_an_allowed_root_is_read(tree):
    storage = make_file_storage(EngineConfig(allowed_feature_paths=(str(tree / "root"),)))
    good = (tree / "root" / "sub" / "good.npy").read_bytes()
    urls = [f"file://{tree}/root/sub/good.npy", f"file://{tree}/root/link_in.npy",
            f"file://localhost{tree}/root/sub/../sub/good.npy"]
    assert storage.fetch(urls[0]) == good
    assert list(storage.fetch_many(urls)) == [good] * 3


@pytest.mark.parametrize("path", ["root/../secret.npy", "root/sub/../../secret.npy", "root/%2e%2e/secret.npy",
                                  "root/link_out.npy", "secret.npy", "root2/near.npy"])
def test_paths_outside_the_root_are_refused(tree, path):
    storage = FileStorage([str(tree / "root")])
    with pytest.raises(FeatureAccessDeniedError, match="outside the directories allowed"):
        storage.fetch(f"file://{tree}/{path}")


def test_a_root_given_through_a_symlink_still_works(tree):
    os.symlink(tree / "root", tree / "alias")
    assert FileStorage([str(tree / "alias")]).fetch(f"file://{tree}/root/sub/good.npy").startswith(b"\x93NUMPY")


def test_no_roots_refuses_every_file_url(tree, monkeypatch):
    monkeypatch.delenv("FDPLUG_ALLOWED_FEATURE_PATHS", raising=False)
    storage = make_file_storage(EngineConfig())
    with pytest.raises(FeatureAccessDeniedError) as err:
        storage.fetch(f"file://{tree}/root/sub/good.npy")
    assert "FDPLUG_ALLOWED_FEATURE_PATHS" in str(err.value)


def test_roots_come_from_the_environment(tree, monkeypatch):
    monkeypatch.setenv("FDPLUG_ALLOWED_FEATURE_PATHS", f"/nonexistent{os.pathsep}{tree / 'root'}")
    assert make_file_storage(EngineConfig()).fetch(f"file://{tree}/root/sub/good.npy").startswith(b"\x93NUMPY")


@pytest.mark.parametrize("url", ["file://otherhost/etc/passwd", "file:relative/path.npy", "file:///x.npy?y=1"])
def test_malformed_file_urls_are_refused(tree, url):
    with pytest.raises(FeatureAccessDeniedError):
        FileStorage([str(tree)]).fetch(url)


def test_missing_file_and_directory_are_not_found(tree):
    storage = FileStorage([str(tree / "root")])
    with pytest.raises(FeatureNotFoundError, match="does not exist"):
        storage.fetch(f"file://{tree}/root/nope.npy")
    with pytest.raises(FeatureNotFoundError, match="directory"):
        storage.fetch(f"file://{tree}/root/sub")


def test_a_fifo_is_refused_without_blocking(tree):
    os.mkfifo(tree / "root" / "pipe.npy")
    with pytest.raises(FeatureNotFoundError, match="not a file"):
        FileStorage([str(tree / "root")]).fetch(f"file://{tree}/root/pipe.npy")


def test_fetch_many_checks_every_url_before_reading(tree):
    with pytest.raises(FeatureAccessDeniedError):
        FileStorage([str(tree / "root")]).fetch_many([f"file://{tree}/root/sub/good.npy", f"file://{tree}/secret.npy"])


# ---------------------------------------------------------------------------------------------------
# http(s)://
# ---------------------------------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hits: list[str] = []

    def do_GET(self):  # noqa: N802
        self.server.hits.append(self.path)
        route = self.path.split("?", 1)[0]
        if route == "/small.bin":
            return self._send(200, b"0123456789")
        if route == "/big-declared.bin":
            return self._send(200, b"x" * 5000)
        if route == "/big-chunked.bin":
            return self._chunked([b"y" * 1000] * 50)
        if route == "/slow.bin":
            time.sleep(1.0)
            return self._send(200, b"late")
        if route == "/redirect.bin":
            self.send_response(302)
            self.send_header("Location", "http://169.254.169.254/latest")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        return self._send(404, b"not found")

    def _send(self, status, body):
        try:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass  # the client gave up (timeout test)

    def _chunked(self, chunks):
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for chunk in chunks:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass  # the client hung up at its size limit

    def log_message(self, *args):
        pass


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # clients hang up on purpose here (size limit, timeout)


@pytest.fixture
def web():
    server = _QuietServer(("127.0.0.1", 0), _Handler)
    server.hits = []
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def url_of(server, path):
    return f"http://127.0.0.1:{server.server_address[1]}{path}"


@pytest.fixture
def http_storages():
    made = []

    def make(hosts=("127.0.0.1",), max_bytes=4096, timeout=5.0):
        made.append(HttpStorage(hosts, max_bytes, timeout))
        return made[-1]

    yield make
    for storage in made:
        storage.close()


def test_an_allowed_host_is_fetched(web, http_storages):
    port = web.server_address[1]
    for hosts in (("127.0.0.1",), (f"127.0.0.1:{port}",), ("other.example", "127.0.0.1")):
        storage = http_storages(hosts)
        assert list(storage.fetch_many([url_of(web, "/small.bin")] * 2)) == [b"0123456789"] * 2


@pytest.mark.parametrize("hosts", [(), ("example.com",), ("127.0.0.1:1",), ("*.example.com",)])
def test_a_host_not_allowed_is_refused_without_a_request(web, http_storages, hosts):
    with pytest.raises(FeatureAccessDeniedError) as err:
        http_storages(hosts).fetch(url_of(web, "/small.bin"))
    assert "FDPLUG_ALLOWED_FEATURE_HOSTS" in str(err.value)
    assert web.hits == []


@pytest.mark.parametrize("url", ["http://127.0.0.1/a\x01b.npy", "http://127.0.0.1/a b.npy", "http://127.0.0.1/\x7f",
                                 "http://[::1/x.npy", "http://127.0.0.1:99999/x.npy", "http://127.0.0.1:x/y"])
def test_a_malformed_url_is_the_clients_400_and_never_sent(web, http_storages, url):
    with pytest.raises(FeatureAccessDeniedError) as err:
        http_storages().fetch(url)
    assert err.value.http_status == 400
    assert web.hits == []


def test_hosts_and_limits_come_from_the_environment(web, monkeypatch):
    monkeypatch.setenv("FDPLUG_ALLOWED_FEATURE_HOSTS", "example.com, 127.0.0.1")
    monkeypatch.setenv("FDPLUG_HTTP_FEATURE_MAX_BYTES", "8")
    storage = make_http_storage(EngineConfig())
    try:
        with pytest.raises(FeatureAccessDeniedError, match="limit is 8 bytes"):
            storage.fetch(url_of(web, "/small.bin"))
    finally:
        storage.close()


def test_the_size_limit_is_enforced_from_the_header_and_while_streaming(web, http_storages):
    storage = http_storages(max_bytes=4096)
    with pytest.raises(FeatureAccessDeniedError, match="is 5000 bytes; the limit is 4096"):
        storage.fetch(url_of(web, "/big-declared.bin"))
    with pytest.raises(FeatureAccessDeniedError, match="more than 4096 bytes"):
        storage.fetch(url_of(web, "/big-chunked.bin"))


def test_a_slow_server_times_out(web, http_storages):
    start = time.perf_counter()
    with pytest.raises(StorageTimeoutError, match="slow.bin"):
        http_storages(timeout=0.2).fetch(url_of(web, "/slow.bin"))
    assert time.perf_counter() - start < 0.8


def test_statuses_map_to_typed_errors_and_hide_the_query(web, http_storages):
    storage = http_storages()
    with pytest.raises(FeatureNotFoundError) as err:
        storage.fetch(url_of(web, "/gone.bin?token=SECRETtoken123"))
    assert "404" in str(err.value) and "SECRETtoken123" not in str(err.value) + err.value.url
    with pytest.raises(FeatureAccessDeniedError, match="redirects are not followed"):
        storage.fetch(url_of(web, "/redirect.bin"))
