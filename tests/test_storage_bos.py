"""BOS storage against a loopback BOS server, through the real bce-python-sdk (no mocks)."""

from __future__ import annotations

import logging
import random
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest

from fdplug.core.config import EngineConfig
from fdplug.errors import (
    ConfigError,
    FeatureAccessDeniedError,
    FeatureNotFoundError,
    StorageError,
    StorageTimeoutError,
)
from fdplug.plugin_api.settings import Setting, parse_positive_int
from fdplug.plugins.storage_bos import make_storage
from fdplug.plugins.storage_bos.settings import SETTINGS as BOS_SETTINGS
from fdplug.plugins.storage_bos.settings import BosSettings
from fdplug.plugins.storage_bos.storage import BosStorage
from fdplug.testing.bos_server import LoopbackBos
from tests.conftest import subprocess_env

AK = "AKfdplugTESTak7f3e9d1"
SK = "SKfdplugTESTsk2c81d44"
STS = "STSfdplugTESTtoken5590"
BUCKET = "feats"
BOS_ENV = ("FDPLUG_BOS_ENDPOINT", "FDPLUG_BOS_AK", "FDPLUG_BOS_SK", "FDPLUG_BOS_STS_TOKEN",
           "ENCODE_FEATURE_ENDPOINT", "ENCODE_FEATURE_BOS_AK", "ENCODE_FEATURE_BOS_SK", "FD_BOS_DOWNLOAD_PARALLEL",
           "FDPLUG_BOS_MAX_RETRIES", "FDPLUG_BOS_RETRY_DEADLINE")


@pytest.fixture
def bos():
    with LoopbackBos(access_key=AK) as server:
        yield server


@pytest.fixture
def storages():
    made: list[BosStorage] = []

    def make(server: LoopbackBos, **overrides) -> BosStorage:
        fields = dict(endpoint=server.endpoint, access_key=AK, secret_key=SK, sts_token=STS, timeout=5.0,
                      parallel=4, max_retries=3, retry_deadline=10.0, retry_base=0.01, retry_cap=0.04)
        made.append(BosStorage(BosSettings(**{**fields, **overrides})))
        return made[-1]

    yield make
    for storage in made:
        storage.close()


def put_many(server: LoopbackBos, n: int, latency: float = 0.0, prefix: str = "img") -> tuple[list[str], list[bytes]]:
    """n objects under multi-segment keys; each payload names its index so order is checkable."""
    blobs = [f"feature-{i}-".encode() * (i + 1) for i in range(n)]
    urls = [server.put(BUCKET, f"{prefix}/req/{i}/feat.npy", blob, latency=latency) for i, blob in enumerate(blobs)]
    return urls, blobs


def key_of(i: int, prefix: str = "img") -> str:
    return f"{prefix}/req/{i}/feat.npy"


# ---------------------------------------------------------------------------------------------------
# order, parallel vs sequential
# ---------------------------------------------------------------------------------------------------


def test_order_is_preserved_under_random_latencies(bos, storages):
    urls, blobs = put_many(bos, 24)
    rng = random.Random(7)
    for i in range(24):
        bos.set_latency(BUCKET, key_of(i), rng.uniform(0.0, 0.04))
    assert list(storages(bos, parallel=6).fetch_many(urls)) == blobs


def test_sequential_and_parallel_paths_give_identical_results(bos, storages):
    urls, blobs = put_many(bos, 12, latency=0.005)
    sequential = list(storages(bos, parallel=1).fetch_many(urls))
    arrivals = [bos.request_times(BUCKET, key_of(i))[0] for i in range(12)]
    parallel = list(storages(bos, parallel=4).fetch_many(urls))
    assert sequential == parallel == blobs
    assert arrivals == sorted(arrivals)  # the sequential path asked in order, one at a time


def test_a_single_link_takes_the_sequential_path(bos, storages):
    urls, blobs = put_many(bos, 1)
    storage = storages(bos, parallel=8)
    assert list(storage.fetch_many(urls)) == blobs
    assert storage.fetch(urls[0]) == blobs[0]
    assert storage._pool is None  # no worker thread was started for one link


def test_parallel_links_are_fetched_at_once_and_sequential_ones_one_by_one(bos, storages):
    """Counted by the server (the most requests it was answering at once), not timed: each answer
    takes 50 ms, so a parallel fetch has several in flight together and a sequential one never two."""
    urls, blobs = put_many(bos, 8, latency=0.05)
    assert list(storages(bos, parallel=1).fetch_many(urls)) == blobs
    assert bos.max_in_flight == 1
    assert list(storages(bos, parallel=8).fetch_many(urls)) == blobs
    assert bos.max_in_flight >= 2, bos.max_in_flight


# ---------------------------------------------------------------------------------------------------
# failures: cancellation, retries, fail-fast
# ---------------------------------------------------------------------------------------------------


def test_first_failure_stops_the_rest(bos, storages):
    # The good links answer in 200 ms, the missing one at once: its failure is known well before any
    # window slot frees (at 20 ms a loaded CI machine, pytest -n auto, had started links 4-6 first).
    urls, blobs = put_many(bos, 40, latency=0.2)
    missing = f"bos://{BUCKET}/{key_of(2, 'gone')}"
    urls[2] = missing
    got = []
    with pytest.raises(FeatureNotFoundError) as err:
        for data in storages(bos, parallel=4).fetch_many(urls):
            got.append(data)
    assert got == blobs[:2]  # everything before the failure, in order, and nothing after it
    assert missing in str(err.value)
    started_at_failure = bos.request_count()
    time.sleep(0.3)  # in-flight downloads finish; nothing new may start
    assert bos.request_count() == started_at_failure
    # links 0-3 were running when link 2 failed at once; the queued rest of the window was cancelled
    assert len(bos.requested_keys()) <= 4 + 1, "far fewer than 40 started"


def test_a_link_that_succeeds_after_retries_keeps_every_later_feature(bos, storages, caplog):
    urls, blobs = put_many(bos, 20, latency=0.005)
    bos.fail(BUCKET, key_of(3), status=503, code="SlowDown", times=2)
    bos.drop(BUCKET, key_of(7), times=1)
    bos.fail(BUCKET, key_of(11), status=429, code="RequestRateLimitExceeded", times=1)
    bos.fail(BUCKET, key_of(15), status=500, code="InternalError", times=1)
    caplog.set_level(logging.WARNING, logger="fdplug.storage.bos")
    assert list(storages(bos, parallel=4).fetch_many(urls)) == blobs
    counts = {i: bos.request_count(BUCKET, key_of(i)) for i in range(20)}
    assert (counts[3], counts[7], counts[11], counts[15]) == (3, 2, 2, 2)
    assert all(c == 1 for i, c in counts.items() if i not in (3, 7, 11, 15))
    assert sum("retry" in r.getMessage() and urls[3] in r.getMessage() for r in caplog.records) == 2


def test_sequential_retry_keeps_every_later_feature(bos, storages):
    urls, blobs = put_many(bos, 6)
    bos.fail(BUCKET, key_of(1), status=503, code="SlowDown", times=1)
    assert list(storages(bos, parallel=1).fetch_many(urls)) == blobs


def test_404_fails_at_once_without_retry(bos, storages):
    url = f"bos://{BUCKET}/no/such/key.npy"
    with pytest.raises(FeatureNotFoundError) as err:
        storages(bos, max_retries=5).fetch(url)
    assert bos.request_count(BUCKET, "no/such/key.npy") == 1
    assert url in str(err.value) and "404" in str(err.value) and err.value.fix


def test_403_is_not_retried_by_us(bos, storages):
    bos.put(BUCKET, "a.npy", b"x")
    storage = storages(bos, access_key="AKsomeoneElse", max_retries=5, retry_base=1.0)
    start = time.perf_counter()
    with pytest.raises(FeatureAccessDeniedError) as err:
        storage.fetch(f"bos://{BUCKET}/a.npy")
    # the SDK itself re-signs once on 403 (clock skew); our policy adds no attempt and no backoff
    assert bos.request_count(BUCKET, "a.npy") <= 2
    assert time.perf_counter() - start < 0.5
    assert "403" in str(err.value) and "FDPLUG_BOS_AK" in str(err.value)


def test_retries_are_bounded_in_count(bos, storages):
    bos.put(BUCKET, "busy.npy", b"x")
    bos.fail(BUCKET, "busy.npy", status=503, code="SlowDown", times=10)
    with pytest.raises(StorageError) as err:
        storages(bos, max_retries=2).fetch(f"bos://{BUCKET}/busy.npy")
    assert bos.request_count(BUCKET, "busy.npy") == 3
    assert "3 attempts" in str(err.value) and "SlowDown" in str(err.value)
    assert "FD_BOS_DOWNLOAD_PARALLEL" in err.value.fix


def test_retries_are_bounded_in_time(bos, storages):
    bos.put(BUCKET, "down.npy", b"x")
    bos.fail(BUCKET, "down.npy", status=502, code="BadGateway", times=1000)
    start = time.perf_counter()
    with pytest.raises(StorageError):
        storages(bos, max_retries=1000, retry_deadline=0.3, retry_base=0.02, retry_cap=0.08).fetch(
            f"bos://{BUCKET}/down.npy")
    assert time.perf_counter() - start < 0.6
    assert 2 < bos.request_count(BUCKET, "down.npy") < 40


def test_a_slow_object_times_out(bos, storages):
    bos.put(BUCKET, "slow.npy", b"x", latency=1.0)
    start = time.perf_counter()
    with pytest.raises(StorageTimeoutError) as err:
        storages(bos, max_retries=0).fetch(f"bos://{BUCKET}/slow.npy", timeout=0.2)
    assert time.perf_counter() - start < 0.8
    assert "slow.npy" in str(err.value)


def test_close_interrupts_a_backoff_sleep(bos, storages):
    bos.put(BUCKET, "flaky.npy", b"x")
    bos.fail(BUCKET, "flaky.npy", status=503, code="SlowDown", times=100)
    storage = storages(bos, retry_base=5.0, retry_cap=5.0, max_retries=10, retry_deadline=60.0)
    errors: list[Exception] = []
    worker = threading.Thread(target=lambda: _capture(errors, storage.fetch, f"bos://{BUCKET}/flaky.npy"))
    worker.start()
    while bos.request_count(BUCKET, "flaky.npy") == 0:
        time.sleep(0.005)
    storage.close()
    worker.join(timeout=2)
    assert not worker.is_alive() and "closed" in str(errors[0])
    with pytest.raises(StorageError, match="closed"):
        list(storage.fetch_many([f"bos://{BUCKET}/flaky.npy"] * 2))


def test_close_during_a_parallel_fetch_fails_it_cleanly(bos, storages):
    urls, _ = put_many(bos, 12, latency=0.05)
    storage = storages(bos, parallel=2)
    gen = storage.fetch_many(urls)
    next(gen)
    storage.close()  # waits for the two running downloads, cancels the queued ones
    with pytest.raises(StorageError, match="closed"):
        list(gen)
    assert len(bos.requested_keys()) <= 4


def _capture(errors: list, fn, *args) -> None:
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001
        errors.append(exc)


# ---------------------------------------------------------------------------------------------------
# secrets
# ---------------------------------------------------------------------------------------------------


def test_credentials_never_appear_in_errors_or_logs(bos, storages, caplog):
    caplog.set_level(logging.DEBUG)
    bos.put(BUCKET, "ok.npy", b"fine")
    bos.put(BUCKET, "flaky.npy", b"x")
    bos.fail(BUCKET, "flaky.npy", status=503, code="SlowDown", times=10)
    bos.put(BUCKET, "dropped.npy", b"x")
    bos.drop(BUCKET, "dropped.npy", times=10)
    bos.put(BUCKET, "slow.npy", b"x", latency=0.5)
    good, wrong_key = storages(bos, max_retries=1), storages(bos, access_key=AK + "x", max_retries=1)
    assert good.fetch(f"bos://{BUCKET}/ok.npy") == b"fine"
    errors = [_error_of(good.fetch, f"bos://{BUCKET}/{key}") for key in ("missing.npy", "flaky.npy", "dropped.npy")]
    errors.append(_error_of(good.fetch, f"bos://{BUCKET}/slow.npy", timeout=0.1))
    errors.append(_error_of(wrong_key.fetch, f"bos://{BUCKET}/ok.npy"))
    errors.append(_error_of(lambda: list(good.fetch_many([f"bos://{BUCKET}/ok.npy", f"bos://{BUCKET}/flaky.npy"]))))
    assert [type(e) for e in errors] == [FeatureNotFoundError, StorageError, StorageError, StorageTimeoutError,
                                         FeatureAccessDeniedError, StorageError]
    shown = [text for e in errors for text in (str(e), repr(e), e.url, e.fix or "", _traceback(e))]
    shown += [r.getMessage() for r in caplog.records] + [caplog.text, repr(good), repr(good.settings)]
    assert any(r.name.startswith("baidubce") for r in caplog.records), "the SDK's debug lines were exercised"
    for secret in (AK, SK, STS):
        assert not [text for text in shown if secret in text], f"{secret} leaked"


def _error_of(fn, *args, **kwargs) -> Exception:
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001
        return exc
    raise AssertionError("expected an error")


def _traceback(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def test_credentials_are_declared_secret():
    for name in ("FDPLUG_BOS_AK", "FDPLUG_BOS_SK", "FDPLUG_BOS_STS_TOKEN", "ENCODE_FEATURE_BOS_AK",
                 "ENCODE_FEATURE_BOS_SK"):
        assert {s.name: s for s in BOS_SETTINGS}[name].secret, name


def test_doctor_lists_credentials_without_their_values():
    env = {"FDPLUG_BOS_SK": "SKdoctorMUSTnotSHOW6d2e", "ENCODE_FEATURE_BOS_AK": "AKdoctorMUSTnotSHOW91ab",
           "FDPLUG_BOS_ENDPOINT": "http://bos.example.test:8080"}
    out = subprocess.run([str(Path(sys.executable).parent / "fdplug"), "doctor"], capture_output=True, text=True,
                         timeout=120, env=subprocess_env(**env))
    assert out.returncode == 0, out.stderr
    listed = {line.strip().partition("=")[0]: line.strip().partition("=")[2] for line in out.stdout.splitlines()
              if "=" in line and line.strip().partition("=")[0] in env}
    assert listed == {"FDPLUG_BOS_SK": "<hidden>", "ENCODE_FEATURE_BOS_AK": "<hidden>",
                      "FDPLUG_BOS_ENDPOINT": "'http://bos.example.test:8080'"}   # a non-secret shows its value
    for name in ("FDPLUG_BOS_SK", "ENCODE_FEATURE_BOS_AK"):
        assert env[name] not in out.stdout + out.stderr


def test_a_malformed_secret_setting_is_not_echoed(monkeypatch):
    """A parser's own message may quote the value (int(): "invalid literal ... 'VALUE'"): not for a secret."""
    value = "SKmalformedMUSTnotSHOW77f0"
    monkeypatch.setenv("FDPLUG_TEST_SECRET_NUMBER", value)
    err = _error_of(Setting("FDPLUG_TEST_SECRET_NUMBER", None, parse_positive_int, "A secret number.",
                            secret=True).value)
    assert isinstance(err, ConfigError) and "FDPLUG_TEST_SECRET_NUMBER=<hidden> is invalid" in str(err)
    assert value not in str(err) + repr(err) + (err.fix or "") + _traceback(err)


def test_a_malformed_plain_setting_shows_its_value(monkeypatch):
    """The counterpart of the test above: what a secret hides, any other setting shows."""
    monkeypatch.setenv("FDPLUG_TEST_PLAIN_NUMBER", "notanumber")
    err = _error_of(Setting("FDPLUG_TEST_PLAIN_NUMBER", None, parse_positive_int, "A number.").value)
    assert isinstance(err, ConfigError) and "FDPLUG_TEST_PLAIN_NUMBER='notanumber' is invalid" in str(err)


# ---------------------------------------------------------------------------------------------------
# settings, URLs, plugin
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["bos://feats", "bos://feats/", "bos:///key.npy", "bos://feats/k.npy?x=1",
                                 "bos://Bad_Bucket/k.npy", "bos://ab/k.npy"])
def test_malformed_urls_are_refused_before_any_request(bos, storages, url):
    with pytest.raises(FeatureAccessDeniedError, match="bos://<bucket>/<key>"):
        list(storages(bos).fetch_many([f"bos://{BUCKET}/fine.npy", url]))
    assert bos.request_count() == 0


def test_credentials_in_a_url_are_refused_and_not_echoed(bos, storages):
    err = _error_of(storages(bos).fetch, f"bos://{AK}:{SK}@{BUCKET}/k.npy")
    assert isinstance(err, FeatureAccessDeniedError) and SK not in str(err) and AK not in str(err)


def test_factory_reads_env_with_fdplug_names_first(bos, monkeypatch):
    for name in BOS_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ENCODE_FEATURE_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("ENCODE_FEATURE_BOS_AK", "AKold")
    monkeypatch.setenv("ENCODE_FEATURE_BOS_SK", SK)
    monkeypatch.setenv("FDPLUG_BOS_ENDPOINT", bos.endpoint)
    monkeypatch.setenv("FDPLUG_BOS_AK", AK)
    monkeypatch.setenv("FD_BOS_DOWNLOAD_PARALLEL", "3")
    urls, blobs = put_many(bos, 5)
    storage = make_storage(EngineConfig(fetch_timeout=4.0))
    try:
        assert list(storage.fetch_many(urls)) == blobs
        settings = storage.settings
        assert (settings.endpoint, settings.access_key, settings.secret_key) == (bos.endpoint, AK, SK)
        assert (settings.parallel, settings.timeout, settings.sts_token) == (3, 4.0, None)
    finally:
        storage.close()


def test_missing_settings_fail_at_first_fetch_naming_the_variables(monkeypatch):
    for name in BOS_ENV:
        monkeypatch.delenv(name, raising=False)
    storage = make_storage(EngineConfig())  # building never needs credentials
    with pytest.raises(ConfigError) as err:
        storage.fetch("bos://feats/a.npy")
    assert "FDPLUG_BOS_AK" in str(err.value) and "ENCODE_FEATURE_BOS_SK" in str(err.value)
    storage.close()


def test_bos_plugin_is_registered_and_light():
    code = ("import sys, fdplug.plugins.storage_bos, fdplug.plugins.storage_fs\n"
            "from fdplug.core.plugin_loading.loader import load_plugins\n"
            "entry = load_plugins(reload=True).registry.get('storage', 'bos')\n"
            "assert entry is not None and entry.spec.schemes == ('bos',), entry\n"
            "heavy = [m for m in sys.modules if m.split('.')[0] in ('baidubce', 'httpx')]\n"
            "assert not heavy, heavy\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
