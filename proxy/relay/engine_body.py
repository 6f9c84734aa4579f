"""What a request's body becomes for the engine it is sent to: an alias's model name, and
the request's priority for engines that schedule by priority themselves.

The body goes upstream as the client sent it, bytes and all, unless one of these applies;
then it is re-serialized once with both changes (:func:`body_for_engine`). It is built per
engine, after the router's choice: a request rerouted to another engine gets that
engine's body.

**Two-level scheduling** (``pools[].engines[].priority_field``): the proxy orders requests
by group before they reach the engine; an engine that also schedules by priority (vLLM
``--scheduling-policy priority``: lower values run first, and it preempts for them under
KV pressure; SGLang ``--enable-priority-scheduling``: higher values first unless
``--schedule-low-priority-values-first``) can be told each request's group rank, so
high-priority work also wins inside the engine. The value written is the group's rank
(0 for the first, highest group), reversed for ``priority_order: higher_first``. It is
written only for engines configured with a ``priority_field``, and it replaces whatever
the client put in that field: a client cannot promote itself.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import orjson

from qos import SchedulerPolicy

from ..wire.request_body import ParsedRequest
from .upstream_body import UpstreamBody, plan_upstream_body

if TYPE_CHECKING:
    from ..config.pools import EngineSpec
    from .request_kinds import RequestKind
    from .upstream import Upstream


def priority_value(rank: int, groups: int, order: str) -> int:
    """The priority an engine is sent for a request of the ``rank``-th group (0: the
    highest) of ``groups``: ``rank`` for ``lower_first`` engines (vLLM), ``groups - 1 -
    rank`` for ``higher_first`` ones (SGLang's default).

    Raises:
        ValueError: ``rank`` outside ``0..groups-1``, or an unknown ``order``.
    """
    if not 0 <= rank < groups:
        raise ValueError(f"group rank {rank} outside 0..{groups - 1}")
    if order == "lower_first":
        return rank
    if order == "higher_first":
        return groups - 1 - rank
    raise ValueError(f"unknown priority order {order!r}")


def body_for_engine(
    raw: bytes, fields: dict, upstream_model: str | None = None, priority: tuple[str, int] | None = None
) -> bytes:
    """The bytes to send one engine.

    Args:
        raw: the body as the client sent it (after the proxy's own caps).
        fields: its parsed JSON object.
        upstream_model: the engines' name for an alias (:class:`proxy.routing.model_routing.Route`),
            or ``None``.
        priority: ``(field, value)`` for an engine with a ``priority_field``
            (:func:`priority_value`), or ``None``.

    Returns:
        ``raw`` itself when nothing changes; else ``fields`` with ``model`` and the
        priority field set, serialized (other fields untouched).
    """
    if upstream_model is None and priority is None:
        return raw
    out = dict(fields)
    if upstream_model is not None:
        out["model"] = upstream_model
    if priority is not None:
        out[priority[0]] = priority[1]
    return orjson.dumps(out)


def engine_plan(
    parsed: ParsedRequest,
    kind: RequestKind,
    spec: EngineSpec,
    client: Upstream,
    upstream_model: str | None,
    policy: SchedulerPolicy,
    group: str,
) -> UpstreamBody:
    """What to send one engine for ``parsed`` (bind late: built once the engine is known,
    again for each engine a request is rerouted to).

    The alias's model name and the two-level priority (:func:`body_for_engine`; a
    pass-through body gets only the alias, and only when it is a JSON object that names a
    model; a native LightLLM body goes as it is), then, for chat and completions, the
    proxy's own stream settings for that engine (:func:`proxy.relay.upstream_body.plan_upstream_body`).

    Args:
        parsed: the client's parsed request (after any ``max_tokens`` cap).
        kind: its kind (:class:`proxy.relay.request_kinds.RequestKind`).
        spec: the engine's config (:class:`proxy.config.pools.EngineSpec`).
        client: the engine's connections (its ``accepts_stream_options``).
        upstream_model: the engines' name for an alias
            (:attr:`proxy.routing.model_routing.Route.upstream_model`), or ``None``.
        policy: the scheduler policy (the group's rank among its groups).
        group: the class the request was admitted in.

    Raises:
        BadRequest: ``stream_options`` is not an object.
    """
    if kind.native:
        return UpstreamBody(parsed.body)
    priority = None
    if spec.priority_field is not None and not kind.opaque:
        priority = (spec.priority_field, priority_value(policy.group_index(group), len(policy.groups), spec.priority_order))
    alias = upstream_model if "model" in parsed.fields else None
    if alias is not None or priority is not None:
        body = body_for_engine(parsed.body, parsed.fields, alias, priority)
        parsed = replace(parsed, body=body, fields=orjson.loads(body))
    if not kind.proxy_fields:
        return UpstreamBody(parsed.body)
    return plan_upstream_body(parsed, spec.upstream, client.accepts_stream_options)
