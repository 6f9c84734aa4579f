"""Which of a pool's engines a request goes to, among those that fit
(:meth:`proxy.routing.router.PoolRouter.choose` applies these): the routing policies and
affinity, over :class:`~proxy.routing.engine_state.EngineState` (``h``, fits and
saturated are defined there).

``least_headroom`` (default) picks, among the engines that fit, the one with the largest
``h``; exact ties go to the next engine in config order after the last one picked.
``round_robin`` picks by smooth weighted round robin (nginx's algorithm) among the engines
that fit. Never an engine that does not fit: a saturated, full, ejected or draining
engine gets nothing while another fits.

**Affinity** (optional, ``routing.affinity``): a key (a session header's value, or the
prompt's first ``prefix_chars`` characters) ranks the engines by weighted rendezvous
hashing (Thaler & Ravishankar, "Using name-based mappings to increase hit rates", 1998;
weights as in Schindelhauer & Schomaker, 2005: score ``-weight / ln(u)``, ``u`` a hash of
key and engine name in (0, 1)). Adding or removing an engine moves only the keys whose
first choice it is, about ``1/n`` of them. The request goes to the first engine in that
order that fits, is not saturated, and whose headroom is at least the best headroom minus
``tolerance``; if none qualifies, the policy decides as without a key. Affinity breaks
ties among engines with headroom; it never overrides saturation. No per-key state is kept,
so hostile keys cannot grow memory; a client can steer only its own requests, and only
among engines within ``tolerance`` of the best.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable

from .engine_state import EngineState
from ..config.pools import RoutingConfig


def affinity_key(routing: RoutingConfig, session: str | None, prompt_text: str | None) -> str | None:
    """The affinity key of a request under ``routing.affinity``, or ``None``.

    Args:
        session: the value of the ``session_header`` the request carried, if any.
        prompt_text: the start of its prompt (at least ``prefix_chars`` characters when it
            has that many; see :func:`proxy.wire.prompt_prefix.prompt_prefix`), if any.

    The session wins over the prefix; an empty value counts as absent.
    """
    aff = routing.affinity
    if aff.session_header is not None and session:
        return "s\x00" + session
    if aff.prefix_chars > 0 and prompt_text:
        return "p\x00" + prompt_text[: aff.prefix_chars]
    return None


def _unit_hash(data: bytes) -> float:
    """A uniform float in (0, 1) from ``data`` (BLAKE2b, 64 bits)."""
    n = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")
    return (n + 0.5) / 2.0**64


def rendezvous_order(key: str, engines: Iterable[EngineState]) -> list[EngineState]:
    """``engines`` by weighted rendezvous score for ``key``, best first (module
    docstring). Deterministic for a key and a set of engine names and weights."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()

    def score(e: EngineState) -> float:
        u = _unit_hash(digest + e.name.encode("utf-8", "surrogatepass"))
        return -e.spec.weight / math.log(u)

    return sorted(engines, key=score, reverse=True)


def within_lease(e: EngineState, tokens: int) -> bool:
    """Whether one more request of ``tokens`` stays within ``e``'s lease (if it has one)."""
    if e.lease_slots is not None and e.inflight >= e.lease_slots:
        return False
    return e.lease_tokens is None or e.inflight_tokens + tokens <= e.lease_tokens


def by_affinity(key: str, eligible: list[EngineState]) -> EngineState | None:
    """The first of ``eligible`` in :func:`rendezvous_order` for ``key``, or ``None``
    when there is none."""
    return rendezvous_order(key, eligible)[0] if eligible else None


def round_robin(cands: list[EngineState], commit: bool) -> EngineState:
    """Smooth weighted round robin (nginx ``ngx_http_upstream_get_peer``): every
    candidate gains its weight, the largest total is picked and pays the sum. Without
    ``commit`` (a mere "is there one?"), the first candidate, nothing changed."""
    if not commit:
        return cands[0]
    total = 0.0
    for e in cands:
        e._wrr += e.spec.weight
        total += e.spec.weight
    pick = max(cands, key=lambda e: e._wrr)
    pick._wrr -= total
    return pick
