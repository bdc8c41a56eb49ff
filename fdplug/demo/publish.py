"""Writing a generated model directory once, atomically, safe with concurrent first runs.

Each writer fills its own temporary directory and renames it into place; a loser of the race finds
the winner's complete copy (its marker names a version and every file's hash) and discards its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from fdplug.errors import ConfigError

MARKER = "fdplug-demo.json"



def publish(tmp: Path, target: Path, version: int) -> None:
    """Rename ``tmp`` to ``target``; keep a complete ``target`` that another process already put there."""
    error: OSError | None = None
    for _ in range(5):
        try:
            os.rename(tmp, target)
            return
        except OSError as exc:
            error = exc
            if is_complete(target, version):
                return
        # A broken leftover (interrupted by hand, edited): move it aside, then try again.
        aside = target.with_name(f".{target.name}.broken-{uuid.uuid4().hex}")
        try:
            os.rename(target, aside)
        except FileNotFoundError:
            continue
        shutil.rmtree(aside, ignore_errors=True)
    raise ConfigError(f"could not put the demo model at {target}: {error}.",
                      fix="set FDPLUG_CACHE_DIR to a writable directory, or delete the old one.")


def remove_stale_temps(root: Path, name: str, max_age_s: float = 3600.0) -> None:
    """Temporary directories left by killed runs; an hour old means nobody is writing them."""
    now = time.time()
    for path in root.glob(f".{name}.*"):
        try:
            if now - path.stat().st_mtime > max_age_s:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def is_complete(model_dir: Path, version: int) -> bool:
    """Whether the marker exists, names this version, and every file matches its recorded hash."""
    try:
        marker = json.loads((model_dir / MARKER).read_text(encoding="utf-8"))
        files = marker["files"]
        return marker["version"] == version and bool(files) and all(
            sha256(model_dir / name) == digest for name, digest in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_marker(out_dir: Path, version: int) -> None:
    """The marker, written last: the version and every file's hash."""
    files = sorted(p.name for p in out_dir.iterdir())
    write_json(out_dir / MARKER, {"version": version, "files": {n: sha256(out_dir / n) for n in files}})


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=False) + "\n", encoding="utf-8")
