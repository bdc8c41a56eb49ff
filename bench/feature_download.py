"""Parallel vs sequential BOS feature download, against the loopback BOS server, in one run.

Each of N objects is served after a latency L (a stand-in for BOS's time to first byte). With W
workers the ideal wall time is ceil(N/W) * L; the parallel path should stay within 1.2x of it and the
sequential path takes about N * L. Everything goes through the real bce-python-sdk and BosStorage,
so the numbers include signing, connection set-up and ordering.

    python bench/feature_download.py --n 16 --latency 0.05 --workers 8
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

from fdplug.plugins.storage_bos.settings import BosSettings
from fdplug.plugins.storage_bos.storage import BosStorage
from fdplug.testing.bos_server import LoopbackBos

AK, SK = "AKbenchmark", "SKbenchmark"
TARGET = 1.2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=16, help="links per request")
    parser.add_argument("--latency", type=float, default=0.05, help="seconds the server waits per object")
    parser.add_argument("--workers", type=int, default=8, help="FD_BOS_DOWNLOAD_PARALLEL for the parallel path")
    parser.add_argument("--size", type=int, default=64 * 1024, help="bytes per object")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per path (the median is reported)")
    return parser.parse_args(argv)


def wall_time(storage: BosStorage, urls: list[str], expected: list[bytes], repeats: int) -> float:
    """Median wall time of fetching every URL; each run's results are checked, in order."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        got = list(storage.fetch_many(urls))
        times.append(time.perf_counter() - start)
        if got != expected:
            raise SystemExit("results differ from the objects served (order or content)")
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with LoopbackBos(access_key=AK) as bos:
        blobs = [bytes([i % 256]) * args.size for i in range(args.n)]
        urls = [bos.put("bench", f"req/{i}/feature.npy", blob, latency=args.latency) for i, blob in enumerate(blobs)]

        def storage(parallel: int) -> BosStorage:
            return BosStorage(BosSettings(endpoint=bos.endpoint, access_key=AK, secret_key=SK, parallel=parallel,
                                          timeout=30.0, max_retries=0))

        parallel, sequential = storage(args.workers), storage(1)
        try:
            list(parallel.fetch_many(urls[: max(2, args.workers)]))  # warm-up: client, pool, SDK imports
            t_par = wall_time(parallel, urls, blobs, args.repeats)
            t_seq = wall_time(sequential, urls, blobs, max(1, args.repeats // 2))
        finally:
            parallel.close()
            sequential.close()
    ideal = math.ceil(args.n / args.workers) * args.latency
    ratio = t_par / ideal
    print(f"feature download: N={args.n} links, latency={args.latency * 1e3:.0f} ms, workers={args.workers}, "
          f"{args.size} B each")
    print(f"  sequential  {t_seq * 1e3:8.1f} ms   (N*L = {args.n * args.latency * 1e3:.0f} ms)")
    print(f"  parallel    {t_par * 1e3:8.1f} ms   (ideal ceil(N/W)*L = {ideal * 1e3:.0f} ms)")
    print(f"  ratio to ideal {ratio:.3f} (target <= {TARGET}): {'ok' if ratio <= TARGET else 'MISSED'}")
    print(f"  speedup over sequential {t_seq / t_par:.2f}x")
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
