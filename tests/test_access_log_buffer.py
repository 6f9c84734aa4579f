"""The access log's buffer writes each batch of lines in one write (issue 22), to the
file logrotate left it, with the target's formatter, and never raises into the proxy."""

from __future__ import annotations

import io
import logging
import logging.handlers
import os

import pytest

from proxy.server import ACCESS_LOG_BUFFER, configure_logging
from proxy.telemetry.log_format import AccessLogBuffer, access_formatter


class _CountingStream(io.StringIO):
    """A text stream that remembers each ``write`` it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return super().write(s)


@pytest.fixture
def configured(tmp_path):
    """configure_logging with an access log file in ``tmp_path``; the process's logging
    set back as it was afterwards. Yields (the buffer, its file)."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level, logging.logThreads, logging.logProcesses, logging.logMultiprocessing
    path = tmp_path / "access.log"
    buf = configure_logging("text", str(path))
    target = buf.target
    try:
        yield buf, path
    finally:
        buf.close()
        target.close()
        logging.getLogger("llm_qos.access").removeHandler(buf)
        root.handlers[:], _, logging.logThreads, logging.logProcesses, logging.logMultiprocessing = saved
        root.setLevel(saved[1])


def _record(msg: str, level: int = logging.INFO) -> logging.LogRecord:
    return logging.LogRecord("llm_qos.access", level, __file__, 0, msg, None, None)


def test_a_full_batch_is_one_write_of_every_line_in_order():
    stream = _CountingStream()
    target = logging.StreamHandler(stream)
    target.setFormatter(access_formatter())
    buf = AccessLogBuffer(4, flushLevel=logging.ERROR, target=target)
    for i in range(10):
        buf.handle(_record(f'{{"n":{i}}}'))
    assert len(stream.writes) == 2  # two full batches of 4; 2 lines still held
    buf.flush()
    assert len(stream.writes) == 3
    assert stream.getvalue().splitlines() == [f'{{"n":{i}}}' for i in range(10)]
    buf.flush()  # nothing held: no write
    assert len(stream.writes) == 3


def test_the_worker_formatter_applies_to_every_line_of_a_batch():
    stream = _CountingStream()
    target = logging.StreamHandler(stream)
    target.setFormatter(access_formatter(3))
    buf = AccessLogBuffer(8, target=target)
    buf.handle(_record('{"a":1}'))
    buf.handle(_record('{"a":2}'))
    buf.flush()
    assert stream.writes == ['{"worker":3,"a":1}\n{"worker":3,"a":2}\n']


def test_a_rotated_file_gets_the_next_batch_in_a_new_file(configured):
    buf, path = configured
    log = logging.getLogger("llm_qos.access")
    log.info('{"before":1}')
    buf.flush()
    os.rename(path, path.with_name("access.log.1"))  # what logrotate does
    log.info('{"after":1}')
    log.info('{"after":2}')
    buf.flush()
    assert path.with_name("access.log.1").read_text() == '{"before":1}\n'
    assert path.read_text() == '{"after":1}\n{"after":2}\n'


def test_the_configured_buffer_holds_a_batch_then_writes_it(configured):
    buf, path = configured
    log = logging.getLogger("llm_qos.access")
    for i in range(ACCESS_LOG_BUFFER - 1):
        log.info('{"i":%d}', i)
    assert path.read_text() == ""  # held
    log.info('{"i":%d}', ACCESS_LOG_BUFFER - 1)
    assert path.read_text().splitlines() == [f'{{"i":{i}}}' for i in range(ACCESS_LOG_BUFFER)]


def test_a_target_with_filters_still_applies_them_line_by_line():
    stream = _CountingStream()
    target = logging.StreamHandler(stream)
    target.setFormatter(access_formatter())
    target.addFilter(lambda r: "drop" not in r.getMessage())
    buf = AccessLogBuffer(8, target=target)
    for msg in ('{"keep":1}', '{"drop":1}', '{"keep":2}'):
        buf.handle(_record(msg))
    buf.flush()
    assert stream.getvalue() == '{"keep":1}\n{"keep":2}\n'


def test_a_failed_write_is_reported_and_dropped_not_raised(monkeypatch, tmp_path):
    path = tmp_path / "access.log"
    target = logging.FileHandler(path, encoding="utf-8")
    target.setFormatter(access_formatter())
    buf = AccessLogBuffer(8, target=target)
    buf.handle(_record('{"lost":1}'))
    target.stream.close()  # writing now fails (ValueError: I/O operation on closed file)
    reported = []
    monkeypatch.setattr(target, "handleError", reported.append)
    buf.flush()  # must not raise
    assert len(reported) == 1 and buf.buffer == []
