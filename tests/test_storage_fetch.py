"""Routing URLs to storages, the ordered parallel map, and ``fdplug fetch-features``."""

from __future__ import annotations

import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from click.testing import CliRunner

from fdplug.cli.fetch import fetch_features
from fdplug.core.config import EngineConfig
from fdplug.core.multimodal.fetch import FeatureFetcher
from fdplug.core.plugin_loading.loader import load_plugins
from fdplug.core.plugin_loading.selection import select_storages
from fdplug.core.portable.ordered_fetch import ordered_map
from fdplug.errors import FeatureAccessDeniedError, StorageTimeoutError
from fdplug.plugin_api.storage import display_url
from fdplug.testing.bos_server import LoopbackBos

AK, SK = "AKfetchTEST0b1c", "SKfetchTEST9d8e"


def npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------------
# ordered_map
# ---------------------------------------------------------------------------------------------------


@pytest.fixture
def pool():
    with ThreadPoolExecutor(4) as executor:
        yield executor


def _timeout(item):
    return StorageTimeoutError(f"item {item} too slow")


def test_ordered_map_yields_in_order_whatever_finishes_first(pool):
    def work(i):
        time.sleep((7 - i) * 0.005)  # later items finish first
        return i * 10

    assert list(ordered_map(pool, work, range(8), window=8, wait_timeout=5, on_timeout=_timeout)) == \
        [i * 10 for i in range(8)]


def test_ordered_map_keeps_at_most_window_calls_outstanding(pool):
    running, peak, lock = [0], [0], threading.Lock()

    def work(i):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.005)
        with lock:
            running[0] -= 1
        return i

    started = []
    gen = ordered_map(pool, lambda i: (started.append(i), work(i))[1], range(100), window=3,
                      wait_timeout=5, on_timeout=_timeout)
    assert next(gen) == 0
    time.sleep(0.05)
    assert len(started) <= 3  # the caller has taken one result: at most window submitted beyond it
    assert list(gen) == list(range(1, 100)) and peak[0] <= 3


def test_ordered_map_stops_at_the_first_failure_in_order(pool):
    def work(i):
        if i in (3, 5):
            raise ValueError(f"bad {i}")
        time.sleep(0.002)
        return i

    got = []
    with pytest.raises(ValueError, match="bad 3"):
        for value in ordered_map(pool, work, range(50), window=6, wait_timeout=5, on_timeout=_timeout):
            got.append(value)
    assert got == [0, 1, 2]


def test_a_failure_cancels_queued_later_calls_at_once(pool):
    started = []

    def work(i):
        started.append(i)
        time.sleep({0: 0.2, 1: 0.03}.get(i, 0.06))
        if i == 1:
            raise ValueError("bad 1")
        return i

    gen = ordered_map(pool, work, range(30), window=12, wait_timeout=5, on_timeout=_timeout)
    with pytest.raises(ValueError, match="bad 1"):
        list(gen)
    # 4 workers run 0-3 while 4-11 wait in the queue; 1 fails and cancels them while 0 still runs
    assert sorted(started) == [0, 1, 2, 3]


def test_ordered_map_times_out_waiting_for_a_stuck_call(pool):
    release = threading.Event()
    with pytest.raises(StorageTimeoutError, match="item 1"):
        list(ordered_map(pool, lambda i: i if i != 1 else release.wait(5), range(3), window=3,
                         wait_timeout=0.1, on_timeout=_timeout))
    release.set()


def test_stopping_early_cancels_calls_not_started():
    calls = []
    with ThreadPoolExecutor(1) as executor:
        gen = ordered_map(executor, lambda i: (calls.append(i), time.sleep(0.02))[0], range(20), window=10,
                          wait_timeout=5, on_timeout=_timeout)
        next(gen)
        gen.close()
    assert len(calls) <= 3


# ---------------------------------------------------------------------------------------------------
# routing
# ---------------------------------------------------------------------------------------------------


@pytest.fixture
def bos_env(monkeypatch):
    with LoopbackBos(access_key=AK) as server:
        monkeypatch.setenv("FDPLUG_BOS_ENDPOINT", server.endpoint)
        monkeypatch.setenv("FDPLUG_BOS_AK", AK)
        monkeypatch.setenv("FDPLUG_BOS_SK", SK)
        monkeypatch.delenv("FDPLUG_BOS_STS_TOKEN", raising=False)
        yield server


def test_storage_specs_pick_one_storage_per_scheme():
    specs = select_storages(load_plugins())
    assert {"bos", "file", "http", "https"} <= set(specs)
    assert specs["bos"].name == "bos" and specs["file"].name == "file" and specs["https"].name == "http"


def test_mixed_schemes_keep_their_order(bos_env, tmp_path):
    arrays = [np.full((i + 1, 4), i, np.float32) for i in range(5)]
    urls = []
    for i, arr in enumerate(arrays):
        if i % 2:
            np.save(tmp_path / f"f{i}.npy", arr)
            urls.append(f"file://{tmp_path}/f{i}.npy")
        else:
            urls.append(bos_env.put("bkt", f"x/{i}.npy", npy(arr), latency=0.01 * (5 - i)))
    fetcher = FeatureFetcher(select_storages(load_plugins()), EngineConfig(allowed_feature_paths=(str(tmp_path),)))
    try:
        assert list(fetcher.fetch_many(urls)) == [npy(a) for a in arrays]
    finally:
        fetcher.close()


def test_an_unsupported_scheme_is_refused_before_anything_is_fetched(bos_env):
    url = bos_env.put("bkt", "k.npy", b"x")
    fetcher = FeatureFetcher(select_storages(load_plugins()), EngineConfig())
    with pytest.raises(FeatureAccessDeniedError, match="s3://"):
        list(fetcher.fetch_many([url, "s3://bkt/k.npy"]))
    assert bos_env.request_count() == 0
    fetcher.close()


def test_display_url_hides_userinfo_and_query():
    assert display_url("https://u:pw@h.example/a/b.npy?sig=XYZ") == "https://h.example/a/b.npy?<query hidden>"


# ---------------------------------------------------------------------------------------------------
# fdplug fetch-features
# ---------------------------------------------------------------------------------------------------


def test_cli_fetches_describes_and_saves(bos_env, tmp_path):
    feature = np.arange(24, dtype=np.float16).reshape(6, 4)
    urls = [bos_env.put("bkt", f"deep/key/{i}.npy", npy(feature), latency=0.01) for i in range(3)]
    result = CliRunner().invoke(fetch_features, [*urls, "--out", str(tmp_path / "out"), "--hidden-size", "4"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert all(f"[{i}] {urls[i]}" in lines[i] and "shape=[6, 4] dtype=float16" in lines[i] for i in range(3))
    assert "ms" in lines[0] and lines[-1].startswith("3 feature(s) in")
    saved = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert saved == ["000_0.npy", "001_1.npy", "002_2.npy"]
    np.testing.assert_array_equal(np.load(tmp_path / "out" / "001_1.npy"), feature)


@pytest.mark.parametrize("case, expected", [("missing", "does not exist"), ("hidden", "expected [num_tokens, 8]"),
                                            ("scheme", "no feature storage handles ftp://")])
def test_cli_reports_user_errors_without_a_traceback(bos_env, case, expected):
    url = bos_env.put("bkt", "f.npy", npy(np.zeros((2, 4), np.float32)))
    args = {"missing": ["bos://bkt/nope.npy"], "hidden": [url, "--hidden-size", "8"], "scheme": ["ftp://h/f.npy"]}[case]
    result = CliRunner().invoke(fetch_features, args)
    assert result.exit_code == 1
    assert expected in result.output and "Traceback" not in result.output
    assert AK not in result.output and SK not in result.output
