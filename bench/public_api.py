"""What using prometheus_client and logging through their public API costs per request.

Two hot-path operations had private shortcuts, replaced by public ways:

* **metric children.** ``prometheus_client``'s public ``labels()`` validates and converts
  its arguments and takes a lock on every call. The proxy now keeps the children that
  ``labels()`` returns in its own dict (:class:`proxy.telemetry.metrics.LabelCache`); it used to
  read the library's private ``_metrics`` dict instead, which is the same one dict lookup.
* **the access-log record.** ``Logger.info()`` walks the stack to find the caller's file
  and line (``Logger.findCaller``) for every record, a field the proxy never prints; the
  private ``logging._srcfile = None`` switched that walk off for the whole process. The
  access line is now a ``logging.LogRecord(...)`` built directly (the public class, behind
  an ``isEnabledFor`` check) and passed to ``Logger.handle()``, which skips the walk for
  that one logger (``proxy.telemetry.access_log.log_access``). ``Logger.makeRecord()`` + ``handle()``,
  the other public way, is timed beside it.

For each: the stock public call, the public way the proxy uses, and what it means for
one finished request (5 labelled metric updates and 1 access-log line, as in
``proxy.telemetry.metrics.Metrics.observe_request`` and
``proxy.telemetry.access_log.log_access``). Timings are the median of
``--repeats`` runs of ``--iters`` calls, the operations taking turns (the machine may be
shared).

    python -m bench.public_api
"""

from __future__ import annotations

import argparse
import logging
import logging.handlers
import statistics
import time

from prometheus_client import CollectorRegistry, Counter, Histogram

from proxy.telemetry.log_format import ACCESS_FORMATTER
from proxy.telemetry.metrics import LATENCY_BUCKETS, LabelCache

LABEL_CALLS_PER_REQUEST = 5  # queue_wait, requests, ttft, tokens x2 (proxy.telemetry.metrics.Metrics.observe_request)
LOG_LINES_PER_REQUEST = 1
LINE = '{"user":"alice","group":"platinum","outcome":"ok","detail":null,"queue_wait_s":0.0,"ttft_s":0.0012,"duration_s":0.0031,"prompt_tokens":10,"output_tokens":8}'


def _time(fns: dict, iters: int, repeats: int) -> dict[str, float]:
    """Median microseconds per call of each ``fn(n)`` (running ``n`` iterations). The runs
    take turns (a, b, c, a, b, c, ...), so that on a shared machine every operation sees
    the same noise."""
    runs: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn(iters)
            runs[name].append((time.perf_counter() - t0) / iters * 1e6)
    return {name: statistics.median(r) for name, r in runs.items()}


def label_timings(iters: int, repeats: int) -> dict[str, float]:
    """Microseconds per ``labels(...)`` call of an existing child, stock and cached."""
    r = CollectorRegistry()
    c = Counter("bench_requests", "", ["group", "outcome"], registry=r)
    hist = Histogram("bench_wait_seconds", "", ["group"], buckets=LATENCY_BUCKETS, registry=r)
    cc, ch = LabelCache(c), LabelCache(hist)
    c.labels("platinum", "ok")
    hist.labels("platinum")

    def stock(n: int) -> None:
        for _ in range(n):
            c.labels("platinum", "ok")

    def stock_hist(n: int) -> None:
        for _ in range(n):
            hist.labels("platinum")

    def cached(n: int) -> None:
        for _ in range(n):
            cc.labels("platinum", "ok")

    def cached_hist(n: int) -> None:
        for _ in range(n):
            ch.labels("platinum")

    def cached_inc(n: int) -> None:
        for _ in range(n):
            cc.labels("platinum", "ok").inc()

    return _time({
        "stock labels() (counter, 2 labels)": stock,
        "stock labels() (histogram, 1 label)": stock_hist,
        "LabelCache.labels() (counter)": cached,
        "LabelCache.labels() (histogram)": cached_hist,
        "LabelCache.labels().inc()": cached_inc,
    }, iters, repeats)


def _logger() -> logging.Logger:
    """A logger set up as the proxy's access log (``proxy.server.configure_logging``): a
    MemoryHandler buffering 256 lines, flushing to a stream handler (here on /dev/null)
    with the access log's formatter."""
    log = logging.getLogger("bench.public_api.access")
    log.propagate = False
    log.setLevel(logging.INFO)
    sink = logging.StreamHandler(open("/dev/null", "w"))  # noqa: SIM115 - lives as long as the run
    sink.setFormatter(ACCESS_FORMATTER)
    log.addHandler(logging.handlers.MemoryHandler(256, flushLevel=logging.ERROR, target=sink))
    return log


PROXY_WAY = "LogRecord() + handle() (the proxy's way)"


def log_timings(iters: int, repeats: int) -> dict[str, float]:
    """Microseconds per access-log line, formatting and writing included: ``Logger.info``
    (with the caller lookup); the proxy's way, ``isEnabledFor`` then a ``LogRecord`` made
    directly and passed to ``Logger.handle`` (as ``proxy.telemetry.access_log.log_access``); and
    ``Logger.makeRecord`` + ``Logger.handle`` (without the lookup too)."""
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False  # as the proxy does (public switches)
    log = _logger()

    def info(n: int) -> None:
        for _ in range(n):
            log.info(LINE)

    def direct(n: int) -> None:
        for _ in range(n):
            if log.isEnabledFor(logging.INFO):
                log.handle(logging.LogRecord(log.name, logging.INFO, __file__, 0, LINE, None, None))

    def make_record(n: int) -> None:
        for _ in range(n):
            log.handle(log.makeRecord(log.name, logging.INFO, __file__, 0, LINE, None, None))

    def find_caller(n: int) -> None:
        for _ in range(n):
            log.findCaller()

    out = _time({
        "Logger.info() (finds the caller)": info,
        PROXY_WAY: direct,
        "makeRecord() + handle()": make_record,
        "Logger.findCaller() alone (what is skipped)": find_caller,
    }, iters, repeats)
    for h in log.handlers:
        h.flush()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    labels = label_timings(a.iters, a.repeats)
    logs = log_timings(max(1, a.iters // 4), a.repeats)
    print(f"{'operation':48s} {'µs/call':>9s}")
    for name, us in {**labels, **logs}.items():
        print(f"{name:48s} {us:9.3f}")
    stock = labels["stock labels() (counter, 2 labels)"] * 4 + labels["stock labels() (histogram, 1 label)"]
    cached = labels["LabelCache.labels() (counter)"] * 4 + labels["LabelCache.labels() (histogram)"]
    info, rec = logs["Logger.info() (finds the caller)"], logs[PROXY_WAY]
    print()
    print(f"per request ({LABEL_CALLS_PER_REQUEST} labelled updates, {LOG_LINES_PER_REQUEST} access line):")
    print(f"  labels(): stock {stock:.2f} µs, cached {cached:.2f} µs (saves {stock - cached:.2f} µs)")
    print(f"  access line: Logger.info {info:.2f} µs, LogRecord+handle {rec:.2f} µs (makeRecord+handle {logs['makeRecord() + handle()']:.2f} µs); "
          f"the caller lookup skipped: {logs['Logger.findCaller() alone (what is skipped)']:.2f} µs")


if __name__ == "__main__":
    main()
