"""This replica's link to Redis (:class:`RedisLink`): its two connections, the scripts they
run, and the calls sent on them, each bounded by ``timeout_s``; and how a failed call is
told (:data:`UNREACHABLE`, :func:`still_cancelled`).

Two connections, one for the syncs and one for the reserves: each carries one call or
pipeline at a time (the sync lock, the reserve batcher), so no pool is needed, and a
single-connection client costs the least CPU per call. No call is retried: a failed call is
an outage, decided at once (:mod:`proxy.shared.sync`). A restarted Redis has no scripts
(``NOSCRIPT``): they are loaded and the call is sent once more.
"""

from __future__ import annotations

import asyncio
from typing import Any, Mapping

from redis.asyncio import Redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError, NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from ..config.schema import SharedStateConfig

#: What a call to an unreachable (or too slow) Redis raises.
UNREACHABLE = (RedisError, OSError, TimeoutError)

#: One script call: (script name, KEYS, ARGV).
ScriptCall = tuple[str, list, list]


class RedisLink:
    """The two connections of one replica, and the scripts registered on them.

    Args:
        config: the ``shared_state`` section (``url``, ``timeout_s``, the password).
        replica_id: this replica's id (the clients' names: ``llm-qos:<id>:sync`` and
            ``llm-qos:<id>:reserve``, as ``CLIENT LIST`` shows them).
        scripts: script name -> Lua text, registered on :meth:`connect`.

    Every call raises one of :data:`UNREACHABLE` when Redis does not answer within its
    bound (``timeout_s``, twice that where scripts are loaded again).
    """

    def __init__(self, config: SharedStateConfig, replica_id: str, scripts: Mapping[str, str]) -> None:
        self.config = config
        self.replica_id = replica_id
        self._texts = dict(scripts)
        self._timeout = config.timeout_s
        self._sync: Redis | None = None
        self._reserve: Redis | None = None
        self._scripts: dict = {}

    @property
    def connected(self) -> bool:
        """Whether :meth:`connect` was called and :meth:`close` not since."""
        return self._sync is not None

    def connect(self) -> None:
        """Make both clients and register the scripts (no round trip: a client connects
        on its first call)."""
        self._sync = self._client("sync")
        self._reserve = self._client("reserve")
        for name, text in self._texts.items():
            self._scripts[name] = self._sync.register_script(text)

    def _client(self, role: str) -> Redis:
        return Redis.from_url(
            self.config.url,
            single_connection_client=True,
            socket_timeout=self._timeout,
            socket_connect_timeout=self._timeout,
            retry=Retry(NoBackoff(), 0),  # no retries: a failed call is an outage, decided at once
            decode_responses=True,
            password=self.config.credential(),
            client_name=f"llm-qos:{self.replica_id}:{role}",
        )

    async def close(self) -> None:
        """Close both connections."""
        await self._sync.aclose()
        await self._reserve.aclose()
        self._sync = self._reserve = None

    async def call(self, name: str, keys: list, args: list) -> Any:
        """One script call on the sync connection, unbounded here (the caller bounds it),
        loading the script first if Redis lost it."""
        return await self._scripts[name](keys=keys, args=args)

    async def pipeline(self, calls: list[ScriptCall]) -> list:
        """The sync's script calls in one pipeline on the sync connection; their replies, in
        order. Bounded by ``timeout_s`` (and twice that to load the scripts again once)."""
        for attempt in (0, 1):
            try:
                async with asyncio.timeout(self._timeout):
                    pipe = self._sync.pipeline(transaction=False)
                    for name, keys, args in calls:
                        pipe.evalsha(self._scripts[name].sha, len(keys), *keys, *args)
                    return await pipe.execute()
            except NoScriptError:
                if attempt:
                    raise
                # a restarted Redis has no scripts: load them and send again
                async with asyncio.timeout(self._timeout * 2):
                    for name, _, _ in calls:
                        await self._sync.script_load(self._scripts[name].script)
        raise AssertionError("unreachable")

    async def reserves(self, calls: list[tuple[list, list]]) -> list:
        """One pipeline of ``reserve`` script calls (KEYS, ARGV) on the reserve connection
        (see :class:`proxy.shared.reserve_batcher.ReserveBatcher`); one reply or error per
        call. A lone call goes as a plain EVALSHA (a pipeline costs the client about twice
        the CPU)."""
        script = self._scripts["reserve"]
        for attempt in (0, 1):
            try:
                async with asyncio.timeout(self._timeout):
                    if len(calls) == 1:
                        keys, args = calls[0]
                        try:
                            return [await self._reserve.evalsha(script.sha, len(keys), *keys, *args)]
                        except NoScriptError:
                            raise
                        except RedisError as e:
                            if not isinstance(e, (ConnectionError, RedisTimeoutError)):
                                return [e]  # an error reply for this call alone
                            raise
                    pipe = self._reserve.pipeline(transaction=False)
                    for keys, args in calls:
                        pipe.evalsha(script.sha, len(keys), *keys, *args)
                    out = await pipe.execute(raise_on_error=False)
                    if not any(isinstance(r, NoScriptError) for r in out):
                        return out
                    raise NoScriptError("NOSCRIPT")
            except NoScriptError:
                if attempt:
                    raise
            async with asyncio.timeout(self._timeout):  # a restarted Redis: load, send again
                await self._reserve.script_load(script.script)
        raise AssertionError("unreachable")


def still_cancelled() -> None:
    """Re-raise a cancellation that a client library turned into an error on its way out
    (a timeout expiring in its cleanup while the task was being cancelled): a cancelled
    request handler must stay cancelled, not carry on with a local fallback."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError()


def describe(e: BaseException) -> str:
    """An error as a log line names it: ``Type: message``, or the type alone."""
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
