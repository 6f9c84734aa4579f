"""The Lua scripts Redis runs for the shared state: one ``.lua`` file each in this package
(shipped as package data, see ``pyproject.toml``), read once at import.

==================  ============================================  ======================
script              files, in the order Redis gets them           used by
==================  ============================================  ======================
``lease``           ``lease.lua``                                 :mod:`proxy.shared.leases`
``service``         ``service.lua``                               :mod:`proxy.shared.counters`
``reserve``         ``bucket.lua`` + ``reserve.lua``              :mod:`proxy.shared.rate_limits`
``adjust``          ``bucket.lua`` + ``adjust.lua``               :mod:`proxy.shared.rate_limits`
==================  ============================================  ======================

``bucket.lua`` is a library, not a script: the token bucket's refill and write-back
(``now_ms``, ``load``, ``store``), the Lua twin of :class:`qos.TokenBucket`. Redis's Lua
has no ``require``, so a script that uses it is sent as the two files' texts joined
(:func:`script`); a line number in a Redis error for ``reserve`` or ``adjust`` counts from
the top of ``bucket.lua``.

**Loading.** :class:`proxy.shared.sync.SharedState` registers each script with
redis-py's ``register_script`` (the SHA1 is computed here, no call) and sends ``EVALSHA``;
on ``NOSCRIPT`` (a new or restarted Redis) it sends ``SCRIPT LOAD`` once per script and
resends. So each script is loaded once per Redis lifetime, and no call on a request's path
carries a script's text. Loading at connect instead would add a round trip to start-up
and still need the ``NOSCRIPT`` path for a Redis that restarts later.

**Checks.** ``tests/test_shared_lua.py`` runs ``luac5.1 -p`` on every file here and
``luacheck`` and ``SCRIPT LOAD`` (on a real redis-server) on every script as sent (Redis
runs Lua 5.1), and holds ``bucket.lua`` to :class:`qos.TokenBucket` with property tests.
"""

from __future__ import annotations

from importlib.resources import files

SCRIPTS: dict[str, tuple[str, ...]] = {
    "lease": ("lease.lua",),
    "service": ("service.lua",),
    "reserve": ("bucket.lua", "reserve.lua"),
    "adjust": ("bucket.lua", "adjust.lua"),
}


def source(name: str) -> str:
    """The text of one ``.lua`` file of this package (e.g. ``"bucket.lua"``).

    Raises:
        FileNotFoundError: no such file (a broken install: the package data is missing).
    """
    return files(__name__).joinpath(name).read_text(encoding="utf-8")


def script(name: str) -> str:
    """The text Redis runs for script ``name`` (a key of :data:`SCRIPTS`): its files joined
    in order.

    Raises:
        KeyError: unknown script.
    """
    return "".join(source(f) for f in SCRIPTS[name])
