"""The config model: the schema of the operator's YAML file (the one place config keys are
defined, with their defaults and validation), and its translation into the scheduler's
:class:`qos.SchedulerPolicy`. Reading a file into it is :mod:`proxy.config.loading`.

One concept over 400 lines: every section of the file is a small pydantic model here, so
that a reader finds every key, its default and its check in one place, and the
cross-section rules (:meth:`Config._consistent`) sit beside the sections they join. Only
the ``pools`` section, whose rules are long, has a module of its own
(:mod:`proxy.config.pools`).

Validation is pydantic v2 with unknown keys forbidden, so a typo is an error that names
its key path instead of a silently ignored setting. Every default here is the documented
default (``docs/configuration.md``).
"""

from __future__ import annotations

import hashlib
import os
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from qos import CostModel, GroupPolicy, RateLimit, SchedulerPolicy, UserPolicy
from qos.capacity_control import ControlSettings
from qos.objective_protection import ProtectionSettings
from qos.objectives import DEFAULT_WINDOW_S, OBJECTIVES, Objective

from .pools import EngineServer, PassthroughConfig, PoolConfig, PoolSpec, base_url, check_pools, check_resume, resolve_pools

PositiveFloat = Annotated[float, Field(gt=0)]
# a group's default headroom per group above it, and its most: at saturation a lower
# group's throughput falls by about its headroom (measured on vLLM: tokens per running
# request did not change between 110 and 127 running), so the default costs the lowest
# group at most a tenth
HEADROOM_PER_RANK = 0.025
HEADROOM_DEFAULT_MAX = 0.10


def _secret(value: str | None, env_name: str | None) -> str | None:
    """``value`` if set, else the non-empty environment variable ``env_name``, else None."""
    if value:
        return value
    if env_name:
        return os.environ.get(env_name) or None
    return None


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class RateLimitConfig(_Model):
    """Token-bucket limits; omitted means unlimited."""

    requests_per_minute: PositiveFloat | None = None
    tokens_per_minute: PositiveFloat | None = None

    def to_policy(self) -> RateLimit:
        return RateLimit(self.requests_per_minute, self.tokens_per_minute)


class LoadSignalConfig(_Model):
    """Hold new admissions while the engine reports itself saturated (:mod:`proxy.runtime.load_signal`).

    ``enabled``: ``auto`` (default) polls ``GET /token_load`` on a ``lightllm`` upstream and
    ``GET /metrics`` on an ``openai`` one, and stops polling when that has no vLLM or
    SGLang load metrics (hosted APIs, transformers serve); ``true`` keeps re-probing every
    30 s and warns; ``false`` never polls. ``interval_s`` (0.5): seconds between polls.
    ``saturated_at`` (0.95): the KV-cache fraction in use or reserved at which the engine
    counts as saturated. ``queue_at`` (1): requests waiting inside the engine (vLLM,
    SGLang) at which it counts as saturated; 0 ignores them. ``stale_after_s`` (3.0): a
    reading older than this is ignored, and admission falls back to
    ``admission.max_inflight``; it must exceed ``interval_s``.
    """

    enabled: Literal["auto"] | bool = "auto"
    interval_s: float = Field(default=0.5, ge=0.05, le=60)
    saturated_at: float = Field(default=0.95, gt=0, le=1)
    queue_at: int = Field(default=1, ge=0)
    stale_after_s: PositiveFloat = 3.0

    @model_validator(mode="after")
    def _stale_after_interval(self) -> "LoadSignalConfig":
        if self.stale_after_s <= self.interval_s:
            raise ValueError(f"stale_after_s ({self.stale_after_s:g}) must be greater than interval_s ({self.interval_s:g})")
        return self


class UpstreamConfig(_Model):
    """Where requests go.

    ``stream_non_streaming``: ask the upstream to stream even when the client did not,
    and assemble the answer in the proxy (:mod:`proxy.relay.assemble`), so that a client that
    leaves a non-streaming request aborts the generation on engines that abort only
    streams (``transformers serve``).

    ``stream_usage``: on a stream whose client did not ask for usage, ask the engine for
    it (``stream_options.include_usage``) and remove it before the client sees it, so
    the real token count trues up the fair-share counters (:mod:`proxy.relay.upstream_body`).

    ``kind`` selects protocol quirks: ``openai`` (vLLM, SGLang, transformers serve, hosted
    APIs) or ``lightllm``. ``api_key`` / ``api_key_env`` is the proxy's own credential
    for the upstream; clients' keys are never forwarded. ``load_signal``: see
    :class:`LoadSignalConfig`.

    ``max_model_len``: the engine's context length in tokens (vLLM ``--max-model-len``),
    when known: a request reserves at most that minus its prompt estimate as output,
    whatever its ``max_tokens`` (an engine cannot generate past its context). With
    ``pools``, the default of each engine's own.

    ``server``: the engine's software, when stated (``vllm``, ``sglang``,
    ``transformers``, ``lightllm``, ``hosted``, ``other``; default unset): the proxy
    cannot tell ``openai``-kind engines apart, and resuming preempted streams
    (``preemption.resume``) needs an engine that continues a final assistant message
    (``continue_final_message``: vLLM and SGLang only). With ``pools``, the default of
    each engine's own.
    """

    url: str = "http://127.0.0.1:8001"
    kind: Literal["openai", "lightllm"] = "openai"
    api_key: str | None = None
    api_key_env: str | None = None
    connect_timeout_s: PositiveFloat = 5.0
    first_byte_timeout_s: PositiveFloat = 300.0
    idle_timeout_s: PositiveFloat = 300.0
    keepalive_timeout_s: PositiveFloat = 4.0
    max_connections: int = Field(default=0, ge=0)
    stream_non_streaming: bool = False
    stream_usage: bool = True
    max_model_len: int | None = Field(default=None, ge=1)
    server: EngineServer | None = None
    load_signal: LoadSignalConfig = LoadSignalConfig()

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return base_url(v)

    def credential(self) -> str | None:
        """The upstream API key: ``api_key``, else the variable named by ``api_key_env``."""
        return _secret(self.api_key, self.api_key_env)


class CapacityConfig(_Model):
    """How each engine's capacity (requests it runs at once) is found
    (:mod:`qos.capacity_control`; docs/configuration.md, ``admission.capacity``).

    ``mode``: ``adaptive`` (default): a closed loop per engine finds it from the engine's
    own queue and KV reports and the per-token time the proxy measures; ``max_inflight``,
    when set, is then only its ceiling (and its starting point). ``fixed``: the capacity is
    ``max_inflight`` (8 when unset), as a hand-set number. ``initial`` (16): the starting
    limit when ``max_inflight`` is unset. ``max`` (1024): the ceiling when
    ``max_inflight`` is unset. ``min`` (1): the least it may fall to. ``tpot_slowdown``
    (3.0): the bound on slowing tokens, a multiple of the engine's unloaded time per
    output token. ``backoff`` (0.9): the multiplicative decrease. ``latency_floor`` (0.5):
    latency alone never takes the limit below this fraction of the limit it had when
    tokens were last within the bound.
    """

    mode: Literal["adaptive", "fixed"] = "adaptive"
    initial: int = Field(default=16, ge=1, le=100_000)
    max: int = Field(default=1024, ge=1, le=100_000)
    min: int = Field(default=1, ge=1, le=100_000)
    tpot_slowdown: float = Field(default=3.0, gt=1, le=1000)
    backoff: float = Field(default=0.9, gt=0, lt=1)
    latency_floor: float = Field(default=0.5, ge=0, le=1)

    @model_validator(mode="after")
    def _ordered(self) -> "CapacityConfig":
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        return self

    def settings(self, max_inflight: int | None) -> ControlSettings | None:
        """The controller settings of an engine whose ``max_inflight`` (engine's, else
        ``admission``'s) is ``max_inflight``; ``None`` in ``fixed`` mode."""
        if self.mode == "fixed":
            return None
        ceiling = max_inflight if max_inflight is not None else self.max
        floor = min(self.min, ceiling)
        initial = max_inflight if max_inflight is not None else min(self.initial, ceiling)
        return ControlSettings(
            initial=initial, ceiling=ceiling, floor=floor, tpot_slowdown=self.tpot_slowdown,
            backoff=self.backoff, latency_floor_fraction=self.latency_floor,
        )  # fmt: skip

    def ceiling(self, max_inflight: int | None) -> int:
        """The most requests an engine may ever run: ``max_inflight`` when set, else
        ``max`` (adaptive) or 8 (fixed, the historical default)."""
        if max_inflight is not None:
            return max_inflight
        return self.max if self.mode == "adaptive" else FIXED_DEFAULT_INFLIGHT


FIXED_DEFAULT_INFLIGHT = 8  # admission.max_inflight when unset and capacity.mode is fixed


class PreemptionConfig(_Model):
    """Preemption when the engine is full (``docs/scheduling.md``, Preemption).

    ``enabled`` (true): when the next request to serve (the highest group's head) has
    waited ``after_s`` and no engine it may use has room, one request of a lower group
    that has shown its client nothing (waiting inside the engine, before its first token,
    or non-streaming) is aborted upstream and queued again at the head of its queue; its
    room goes to the waiting request. ``after_s`` (``auto``): seconds, or ``auto`` =
    max(0.25, 2 x the largest baseline time to first token the pool's engines have
    measured), 0.5 while none is measured. ``max_per_request`` (2): the most times one
    request is preempted.

    ``resume`` (false): a lower group's stream that has already shown its client tokens
    may be preempted too, and is resumed where it stopped when dispatched again
    (:mod:`proxy.relay.resume`); the default of every pool (``pools[].preemption.resume``
    overrides it). Only for engines that continue a message (``server: vllm`` or
    ``sglang``: :func:`proxy.config.pools.check_resume`).
    """

    enabled: bool = True
    after_s: Literal["auto"] | Annotated[float, Field(gt=0, le=3600)] = "auto"
    max_per_request: int = Field(default=2, ge=1, le=100)
    resume: bool = False


class AdmissionConfig(_Model):
    """Capacity, queueing and per-user state (see :class:`qos.SchedulerPolicy`).

    ``max_inflight``: requests one engine runs at once: with ``capacity.mode: adaptive``
    (default) an optional ceiling on the capacity found (unset: none but
    ``capacity.max``); with ``fixed``, the capacity itself (default 8).

    ``max_users``: most users whose fair-share state is kept (users with requests queued
    or in flight always are); ``forget_users_after_s``: a user with nothing queued or in
    flight for this long is forgotten (it would be lifted to its class's virtual time
    when it returns anyway). ``hold_slot_s``: seconds a freed slot is kept for the user
    it is owed to that has nothing waiting (a closed-loop client about to send its next
    request); 0 turns it off (:mod:`qos.slot_holds`).
    """

    max_inflight: int | None = Field(default=None, ge=1)
    max_inflight_tokens: int | None = Field(default=None, ge=1)
    capacity: CapacityConfig = CapacityConfig()
    max_queue: int = Field(default=1000, ge=0)
    queue_timeout_s: PositiveFloat = 30.0
    share_window_s: PositiveFloat = 30.0
    max_users: int = Field(default=20000, ge=1)
    forget_users_after_s: PositiveFloat = 300.0
    hold_slot_s: float = Field(default=0.05, ge=0, le=10)
    preemption: PreemptionConfig = PreemptionConfig()

    def starting_inflight(self) -> int:
        """Requests in flight one engine starts with: ``max_inflight`` when set, else
        ``capacity.initial`` (adaptive) or 8 (fixed)."""
        if self.max_inflight is not None:
            return self.max_inflight
        return self.capacity.initial if self.capacity.mode == "adaptive" else FIXED_DEFAULT_INFLIGHT


class CostConfig(_Model):
    """Token cost model for fair sharing (see :class:`qos.CostModel`) and the prompt
    estimate's per-part costs (:mod:`proxy.wire.request_body`).

    ``max_tokens_ceiling``: the most output tokens one choice of a request reserves,
    whatever its ``max_tokens`` (a reservation for capacity and rate limits, never a
    fair-share cost). ``image_tokens`` / ``media_tokens``: prompt tokens counted per
    image part, and per audio, video or file part.
    """

    input_weight: float = Field(default=1.0, ge=0, le=1e6)
    output_weight: float = Field(default=2.0, ge=0, le=1e6)
    default_max_tokens: int = Field(default=256, ge=1)
    max_tokens_ceiling: int = Field(default=32768, ge=1)
    image_tokens: int = Field(default=1024, ge=0)
    media_tokens: int = Field(default=1024, ge=0)


class IdentityConfig(_Model):
    """How a request's user is found.

    An ``Authorization: Bearer KEY`` matching a configured key always wins. ``header``
    (e.g. ``X-User-Id``), when set, names a header a trusted gateway in front sets to
    the user id; it is off by default because clients could forge it.
    ``require_api_key`` answers 401 to requests without a known key.
    """

    header: str | None = None
    require_api_key: bool = False


class AdminConfig(_Model):
    """Credential for ``/admin/*`` routes (``api_key`` or the variable ``api_key_env``)."""

    api_key: str | None = None
    api_key_env: str | None = "LLM_QOS_ADMIN_KEY"

    def credential(self) -> str | None:
        """The admin key: ``api_key``, else the variable named by ``api_key_env``."""
        return _secret(self.api_key, self.api_key_env)


class LimitsConfig(_Model):
    """Request limits enforced before admission.

    ``max_tokens_action`` says what happens to a request whose ``max_tokens`` exceeds its
    group's ``max_tokens`` cap: ``clamp`` lowers it to the cap, ``reject`` answers 400.
    ``max_concurrent_requests`` caps the client requests the process handles at once
    (beyond: 503 at once). ``client_write_timeout_s`` drops a client that has not read
    the stream for that long (its upstream request is aborted).
    """

    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    max_tokens_action: Literal["clamp", "reject"] = "clamp"
    max_concurrent_requests: int = Field(default=20000, ge=1)
    client_write_timeout_s: PositiveFloat = 60.0


class UserConfig(_Model):
    """One user: id, weight inside its group, optional API key (plain or SHA-256 hex)."""

    id: str = Field(min_length=1)
    weight: float = Field(default=1.0, ge=0)
    api_key: str | None = None
    api_key_sha256: str | None = None
    rate_limit: RateLimitConfig = RateLimitConfig()

    @field_validator("api_key_sha256")
    @classmethod
    def _hex(cls, v: str | None) -> str | None:
        if v is not None:
            v = v.lower()
            if len(v) != 64 or any(c not in "0123456789abcdef" for c in v):
                raise ValueError("must be 64 hex digits (sha256 of the key)")
        return v

    @model_validator(mode="after")
    def _one_key(self) -> "UserConfig":
        if self.api_key and self.api_key_sha256:
            raise ValueError("give api_key or api_key_sha256, not both")
        return self

    def key_digest(self) -> str | None:
        """SHA-256 hex digest of this user's key, if any."""
        if self.api_key:
            return hashlib.sha256(self.api_key.encode()).hexdigest()
        return self.api_key_sha256


DEFAULT_OBJECTIVE_PERCENTILE = 95.0  # groups[].ttft_percentile / tpot_percentile when unset


class GroupConfig(_Model):
    """One priority class; groups are listed highest priority first.

    ``max_tokens`` caps the output a request of this group may ask for (see
    ``limits.max_tokens_action``). ``headroom``: the fraction of each engine's capacity
    this group may not fill, kept free for the groups above it (default: 0.05 for each
    group above it, at most 0.10; the top group 0: :meth:`Config.headroom_of`).

    Latency objectives (:mod:`qos.objectives`):
    ``ttft_target_s``, time to first token from arrival (queue included), and
    ``tpot_target_s``, time per output token, each met by ``ttft_percentile`` /
    ``tpot_percentile`` percent of the group's requests (default 95, in (0, 100)). A
    percentile without its target is refused. No target: nothing is measured. While a
    group with objectives misses one, the groups below it give way in steps
    (``objectives.protection``, :mod:`qos.objective_protection`); with protection on, a
    first token later than ``ttft_target_s`` after dispatch also makes the groups below
    leave more of that engine free (:meth:`qos.capacity.RecentPeaks.late`).

    ``on_miss`` (``serve``): ``reject`` refuses at once (``429 objective_unreachable``) a
    request that cannot meet the group's TTFT objective given the group's requests
    waiting before it and its measured drain rate, instead of serving it late; it needs
    ``ttft_target_s``."""

    name: str = Field(min_length=1)
    users: list[UserConfig] = []
    max_queue: int | None = Field(default=None, ge=0)
    min_share: float = Field(default=0.0, ge=0, le=1)
    rate_limit: RateLimitConfig = RateLimitConfig()
    default_user_weight: float = Field(default=1.0, ge=0)
    max_tokens: int | None = Field(default=None, ge=1)
    headroom: float | None = Field(default=None, ge=0, le=0.9)
    ttft_target_s: float | None = Field(default=None, gt=0, le=3600)
    ttft_percentile: float = Field(default=DEFAULT_OBJECTIVE_PERCENTILE, gt=0, lt=100)
    tpot_target_s: float | None = Field(default=None, gt=0, le=3600)
    tpot_percentile: float = Field(default=DEFAULT_OBJECTIVE_PERCENTILE, gt=0, lt=100)
    on_miss: Literal["serve", "reject"] = "serve"

    @model_validator(mode="after")
    def _percentile_with_target(self) -> "GroupConfig":
        if self.on_miss == "reject" and self.ttft_target_s is None:
            raise ValueError("on_miss: reject needs ttft_target_s (the objective a request is refused for missing)")
        for name in OBJECTIVES:
            # by value, not by which keys were written: a config dumped and read again
            # (``--upstream`` rebuilds it so) must read the same
            if getattr(self, f"{name}_percentile") != DEFAULT_OBJECTIVE_PERCENTILE and getattr(self, f"{name}_target_s") is None:
                raise ValueError(f"{name}_percentile is set without {name}_target_s")
        return self

    def objectives(self) -> tuple[Objective, ...]:
        """This group's latency objectives (none, one or both of ``ttft``, ``tpot``)."""
        out = []
        for name in OBJECTIVES:
            target = getattr(self, f"{name}_target_s")
            if target is not None:
                out.append(Objective(name, target, getattr(self, f"{name}_percentile")))
        return tuple(out)


class ProtectionConfig(_Model):
    """Objective protection (``objectives.protection``; the rule:
    :mod:`qos.objective_protection`, docs/scheduling.md).

    ``enabled`` (true): while a group with objectives is at risk in a pool, the groups
    below it give way there in steps (hold their new work, preempt at once, shed their
    newest waiting requests). ``wait_fraction`` (0.5): a group is about to miss when its
    request waiting longest has waited this fraction of its ``ttft_target_s``.
    ``recent_s`` (10): the span of the objectives window whose attainment says a group
    is missing; ``min_requests`` (10): the fewest values in it that say so.
    ``step_s`` (``auto``): seconds each step is given before the next (``auto``: half
    the protected group's ``ttft_target_s``, at least 0.05; 1 s for a ``tpot`` objective
    alone). ``shed_fraction`` (0.5): the part of the lower groups' waiting requests shed
    at each step. ``interval_s`` (0.1): how often each pool is checked while it has work.
    ``drain_window_s`` (10) and ``min_backlog_s`` (1): a group's drain rate (for
    ``on_miss: reject``) is measured over that window, once the group has waited that
    long in it.
    """

    enabled: bool = True
    wait_fraction: float = Field(default=0.5, gt=0, le=1)
    recent_s: float = Field(default=10.0, gt=0, le=3600)
    min_requests: int = Field(default=10, ge=1, le=1_000_000)
    step_s: Literal["auto"] | Annotated[float, Field(gt=0, le=600)] = "auto"
    shed_fraction: float = Field(default=0.5, gt=0, le=1)
    interval_s: float = Field(default=0.1, ge=0.01, le=10)
    drain_window_s: float = Field(default=10.0, ge=1, le=3600)
    min_backlog_s: float = Field(default=1.0, gt=0, le=3600)

    def settings(self) -> ProtectionSettings:
        """These keys as :class:`qos.objective_protection.ProtectionSettings`."""
        return ProtectionSettings(
            enabled=self.enabled, wait_fraction=self.wait_fraction, recent_s=self.recent_s, min_requests=self.min_requests,
            step_s=None if self.step_s == "auto" else float(self.step_s), shed_fraction=self.shed_fraction,
            drain_window_s=self.drain_window_s, min_backlog_s=self.min_backlog_s,
        )  # fmt: skip


class ObjectivesConfig(_Model):
    """How the groups' latency objectives are measured (:mod:`qos.objectives`), and
    kept (``protection``: :class:`ProtectionConfig`).

    ``window_s`` (60): the sliding window attainment and the measured percentile cover,
    seconds (5..3600). A reload that changes it starts every objective's window afresh.
    """

    window_s: float = Field(default=DEFAULT_WINDOW_S, ge=5, le=3600)
    protection: ProtectionConfig = ProtectionConfig()


class SharedStateConfig(_Model):
    """Share one QoS state between proxy processes through Redis (``docs/scaling.md``).

    ``url``: ``redis://[[user]:password@]host:port/db``, ``rediss://`` (TLS) or
    ``unix:///path?db=0`` (one Redis or Valkey server, 6.2 or later, through a plain
    client: Redis Cluster is not supported). ``password_env``: a variable holding the
    password, for a URL without one. ``key_prefix``: the deployment's namespace; every key
    is ``{key_prefix}:...``.
    ``sync_interval_s``: how often each process renews its capacity leases and pushes its
    counters. ``lease_s``: a process that has not renewed for this long loses its grants
    (capacity returns to the others), and a process that cannot reach Redis for this long
    takes its local share. ``timeout_s``: the bound on every Redis call; a call past it
    counts as Redis unreachable. ``expected_replicas``: the fewest processes a process
    assumes when it takes its local share without Redis (capacity and limits ÷ the live
    count Redis last reported, at least this; ``--workers N`` raises it to N).
    ``service_ttl_s``: a user's shared service counter is forgotten after this long
    without service or a waiting request. Changes take effect at the next restart.
    """

    url: str = Field(min_length=1)
    password_env: str | None = None
    key_prefix: str = Field(default="llm-qos", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    sync_interval_s: float = Field(default=0.1, ge=0.02, le=2.0)
    lease_s: float = Field(default=3.0, ge=0.5, le=60.0)
    timeout_s: float = Field(default=0.1, ge=0.005, le=5.0)
    expected_replicas: int = Field(default=1, ge=1, le=1000)
    service_ttl_s: float = Field(default=600.0, ge=1.0)

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix://")
        return v

    @model_validator(mode="after")
    def _lease_covers_syncs(self) -> "SharedStateConfig":
        need = 4 * self.sync_interval_s + 2 * self.timeout_s
        if self.lease_s < need:
            raise ValueError(
                f"lease_s ({self.lease_s:g}) must be at least 4 x sync_interval_s + 2 x timeout_s ({need:g}): "
                "a lease must outlive a few missed renewals"
            )
        return self

    def credential(self) -> str | None:
        """The password from ``password_env``, if set (a password in ``url`` wins)."""
        return _secret(None, self.password_env)


class Config(_Model):
    """The whole configuration file."""

    upstream: UpstreamConfig = UpstreamConfig()
    admission: AdmissionConfig = AdmissionConfig()
    cost: CostConfig = CostConfig()
    identity: IdentityConfig = IdentityConfig()
    admin: AdminConfig = AdminConfig()
    limits: LimitsConfig = LimitsConfig()
    shared_state: SharedStateConfig | None = None
    default_group: str
    groups: list[GroupConfig] = Field(min_length=1)
    # several engines and models: proxy/config/pools.py (None: the single ``upstream`` form)
    pools: list[PoolConfig] | None = Field(default=None, min_length=1)
    passthrough: PassthroughConfig = PassthroughConfig()
    objectives: ObjectivesConfig = ObjectivesConfig()

    @model_validator(mode="after")
    def _consistent(self) -> "Config":
        names = [g.name for g in self.groups]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"group names must be unique, repeated: {sorted(dup)}")
        if self.default_group not in names:
            raise ValueError(f"default_group {self.default_group!r} is not one of the groups {names}")
        ids = [u.id for g in self.groups for u in g.users]
        dup = {i for i in ids if ids.count(i) > 1}
        if dup:
            raise ValueError(f"user ids must be unique across groups, repeated: {sorted(dup)}")
        digests = [d for g in self.groups for u in g.users if (d := u.key_digest())]
        if len(set(digests)) != len(digests):
            raise ValueError("two users share the same api_key")
        if sum(g.min_share for g in self.groups) > 1.0:
            raise ValueError("the min_share of all groups must add up to at most 1")
        check_pools(self)
        check_resume(self)
        return self

    def effective_pools(self) -> tuple[PoolSpec, ...]:
        """The pools this config describes, defaults filled in (the single ``upstream``
        form is one catch-all pool): see :func:`proxy.config.pools.resolve_pools`."""
        return resolve_pools(self)

    def group(self, name: str) -> GroupConfig:
        """The group called ``name``. Raises KeyError."""
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)

    def group_objectives(self) -> dict[str, tuple[Objective, ...]]:
        """group name -> its latency objectives, for the groups that have any."""
        return {g.name: objs for g in self.groups if (objs := g.objectives())}

    def headroom_of(self, rank: int) -> float:
        """The ``headroom`` of the group at ``rank`` (0: the top): its own when set, else
        :data:`HEADROOM_PER_RANK` per group above it, at most :data:`HEADROOM_DEFAULT_MAX`
        (gold 0.025, silver 0.05, bronze 0.075 in the shipped four-group config)."""
        own = self.groups[rank].headroom
        return own if own is not None else min(HEADROOM_DEFAULT_MAX, HEADROOM_PER_RANK * rank)

    def to_policy(self) -> SchedulerPolicy:
        """The scheduler policy this config describes."""
        users = {
            u.id: UserPolicy(u.id, g.name, u.weight, u.rate_limit.to_policy()) for g in self.groups for u in g.users
        }
        return SchedulerPolicy(
            groups=tuple(
                GroupPolicy(g.name, g.max_queue, g.min_share, g.rate_limit.to_policy(), g.default_user_weight, self.headroom_of(i), g.ttft_target_s if self.objectives.protection.enabled else None)
                for i, g in enumerate(self.groups)
            ),
            default_group=self.default_group,
            users=users,
            max_inflight=self.admission.starting_inflight(),
            max_inflight_tokens=self.admission.max_inflight_tokens,
            max_queue=self.admission.max_queue,
            queue_timeout_s=self.admission.queue_timeout_s,
            cost=CostModel(self.cost.input_weight, self.cost.output_weight, self.cost.default_max_tokens, self.cost.max_tokens_ceiling),
            share_window_s=self.admission.share_window_s,
            max_users=self.admission.max_users,
            forget_users_after_s=self.admission.forget_users_after_s,
            hold_slot_s=self.admission.hold_slot_s,
        )


#: Config keys whose values are secrets: ``/admin/config`` shows them as ``***``
#: (:func:`proxy.api.admin.redacted_config`) and no config error message quotes their value.
SECRET_FIELDS = frozenset({"api_key", "api_key_sha256", "password"})
