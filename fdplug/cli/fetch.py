"""``fdplug fetch-features URL...``: fetch features through the same storages the engine uses.

For checking a deployment: are the credentials, allow-lists and formats right, and how long does
each link take? Each line shows when the feature was ready (since the start), the wait for it, and
its decoded shape and dtype. A user error (bad URL, refused path, missing object, wrong format)
prints its message and fix and exits 1, without a traceback.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import click

from fdplug.errors import FdplugError


@click.command("fetch-features")
@click.argument("urls", nargs=-1, required=True)
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write each decoded feature to DIR as <index>_<name>.npy.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Seconds per feature (default: FDPLUG_FETCH_TIMEOUT).")
@click.option("--hidden-size", type=click.IntRange(min=1), default=None,
              help="Also check that every feature is [num_tokens, HIDDEN_SIZE].")
def fetch_features(urls: tuple[str, ...], out_dir: Path | None, timeout: float | None,
                   hidden_size: int | None) -> None:
    """Fetch pre-encoded multimodal features (bos://, file://, http(s)://) and describe each one."""
    from fdplug.core.config import EngineConfig
    from fdplug.core.multimodal.fetch import FeatureFetcher
    from fdplug.core.plugin_loading.loader import current_plugins
    from fdplug.core.plugin_loading.selection import select_storages

    fetcher = None
    try:
        fetcher = FeatureFetcher(select_storages(current_plugins()), EngineConfig())
        _fetch_and_report(fetcher, list(urls), out_dir, timeout, hidden_size)
    except FdplugError as err:
        raise click.ClickException(str(err)) from None
    except OSError as err:  # only --out writes touch the file system outside a storage
        raise click.ClickException(f"cannot write to {out_dir}: {err.strerror or err}.") from None
    finally:
        if fetcher is not None:
            fetcher.close()


def _fetch_and_report(fetcher, urls: list[str], out_dir: Path | None, timeout: float | None,
                      hidden_size: int | None) -> None:
    from fdplug.core.multimodal.features import decode_feature, validate_feature
    from fdplug.plugin_api.storage import display_url

    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    start = last = time.perf_counter()
    for index, (url, data) in enumerate(zip(urls, fetcher.fetch_many(urls, timeout=timeout))):
        now = time.perf_counter()
        array = decode_feature(data, url)
        if hidden_size is not None:
            validate_feature(array, url, None, hidden_size)
        click.echo(f"[{index}] {display_url(url)}  shape={list(array.shape)} dtype={array.dtype} "
                   f"bytes={len(data)}  ready +{(now - start) * 1e3:.1f} ms (waited {(now - last) * 1e3:.1f} ms)")
        last = now
        if out_dir is not None:
            _save(out_dir, index, url, array)
    click.echo(f"{len(urls)} feature(s) in {(time.perf_counter() - start) * 1e3:.1f} ms")


def _save(out_dir: Path, index: int, url: str, array) -> None:
    import numpy as np

    stem = url.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1].rsplit(".", 1)[0]
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", stem)[:80] or "feature"
    np.save(out_dir / f"{index:03d}_{safe}.npy", array)
