"""The ``pools:`` part of the config: which engines serve which models, and how a request
is given an engine. The schema of those keys lives here, once; :mod:`proxy.config.schema` imports
it (this module imports nothing of ours, so there is no cycle).

One concept over 400 lines: the ``pools:`` keys, defined once (the pydantic models, each
key with its check and its error text) and resolved into what routing uses
(:class:`PoolSpec`, :class:`EngineSpec`); the models and their resolution change
together whenever a key is added.

Two forms, one meaning:

* **Single upstream** (the original form): ``upstream:`` names one engine, which serves
  every model; ``admission.max_inflight`` / ``max_inflight_tokens`` are its capacity. It
  is read as one pool, named ``default``, whose only model entry is the catch-all
  ``"*"`` and whose only engine is ``upstream`` (:func:`resolve_pools`).
* **Pools**: ``pools:`` lists pools, each with the model names clients send, its engines
  and a routing policy. ``upstream:`` then holds what every engine shares (timeouts,
  keep-alive, ``stream_non_streaming``, ``load_signal``), and the defaults of ``kind`` and
  ``api_key`` / ``api_key_env``; each engine names its own ``url``, and ``upstream.url``
  must not be given (it would name an engine outside every pool).

A request is routed by its ``model`` (:mod:`proxy.routing.model_routing`). ``"*"`` in a pool's
``models`` makes it the catch-all: it gets every model no pool names. At most one pool
may have it.

Every key and its default is documented in ``docs/configuration.md`` (section ``pools``)
and the routing rules in ``docs/routing.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

CATCH_ALL = "*"
#: Name of the pool the single-upstream form (and ``llm-qos up --engines N``) makes.
DEFAULT_POOL = "default"

#: an engine's software (``upstream.server``, ``pools[].engines[].server``)
EngineServer = Literal["vllm", "sglang", "transformers", "lightllm", "hosted", "other"]
#: the engines that continue a final assistant message (``continue_final_message``:
#: vLLM's and SGLang's chat extensions), which resuming a preempted stream needs
RESUMING_SERVERS = frozenset({"vllm", "sglang"})

_HTTP_TOKEN = r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$"  # RFC 9110 token: a header field name
_POOL_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def base_url(v: str) -> str:
    """An engine's base URL as validated everywhere one is given (``upstream.url``,
    ``pools[].engines[].url``, ``--upstream``): ``http://`` or ``https://``, no query or
    fragment (the proxy appends the request's path and the client's own query string:
    ``http://e:8000?k=1`` would become ``http://e:8000?k=1/v1/chat/completions``), no
    trailing ``/``.

    Raises:
        ValueError: another scheme, or a ``?`` or ``#`` in it.
    """
    if not (v.startswith("http://") or v.startswith("https://")):
        raise ValueError("must start with http:// or https://")
    if "?" in v or "#" in v:
        raise ValueError("must not have a query (?...) or fragment (#...): the client's query string is passed to the upstream as is")
    return v.rstrip("/")


def public_url(url: str) -> str:
    """``url`` fit to show: its ``user:password@`` (an engine's credential, sent as Basic
    auth) written ``***@``; a URL without one is returned unchanged. What an engine's
    default name, ``/ready``, status pages and log lines show, so that no route or log
    line reveals the password (``http://u:p@h:8000`` -> ``http://***@h:8000``)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    authority, slash, path = rest.partition("/")
    if "@" not in authority:
        return url
    return f"{scheme}://***@{authority.rpartition('@')[2]}{slash}{path}"


class ModelEntry(_Model):
    """One model name clients may send.

    ``name``: the ``model`` value clients send (``"*"``: every model no pool names).
    ``upstream_model``: the name the engines know it by, written into the request's
    ``model`` before it goes upstream (an alias); default: ``name``, unchanged. Written as
    a plain string, an entry is just its ``name``.
    """

    name: str = Field(min_length=1, max_length=256)
    upstream_model: str | None = Field(default=None, min_length=1, max_length=256)

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, v: Any) -> Any:
        return {"name": v} if isinstance(v, str) else v

    @model_validator(mode="after")
    def _catch_all_has_no_alias(self) -> "ModelEntry":
        if self.name == CATCH_ALL and self.upstream_model is not None:
            raise ValueError("the catch-all '*' passes the client's model through; it takes no upstream_model")
        return self


class AffinityConfig(_Model):
    """Optional engine affinity (see :mod:`proxy.routing.router`): requests with the same key
    prefer the same engine, so an engine's prefix (KV) cache is hit more often.

    ``session_header``: a request header whose value is the key (e.g. ``X-Session-Id``).
    ``prefix_chars``: when > 0 and the request has no session header, the key is a hash of
    the first ``prefix_chars`` characters of the prompt (0: off). ``tolerance`` (0..1): the
    preferred engine is kept while its headroom is at most this much below the best
    engine's (0: only on exact ties; 1: until it is saturated).
    """

    session_header: str | None = Field(default=None, pattern=_HTTP_TOKEN, max_length=128)
    prefix_chars: int = Field(default=0, ge=0, le=1_000_000)
    tolerance: float = Field(default=0.25, ge=0, le=1)

    @property
    def enabled(self) -> bool:
        """Whether any affinity key is configured."""
        return self.session_header is not None or self.prefix_chars > 0


class RoutingConfig(_Model):
    """How a dispatched request is given one of its pool's engines (:mod:`proxy.routing.router`).

    ``policy``: ``least_headroom`` (default: the engine with the most headroom left) or
    ``round_robin`` (weighted, among engines that fit; for comparison).
    """

    policy: Literal["least_headroom", "round_robin"] = "least_headroom"
    affinity: AffinityConfig = AffinityConfig()


class HealthConfig(_Model):
    """When an engine is taken out of rotation and brought back (:mod:`proxy.routing.engine_health`).

    ``failures_to_eject`` (3): consecutive failed requests (connection refused or reset
    before any answer byte, no headers in time, a 5xx, a stream cut) that eject the engine.
    An error the engine reports in its answer (an in-band error event, a JSON error body)
    counts by the status it names: a 5xx fails, anything else is a success (the engine
    answered, as with a 4xx). A 501 or 505 is a success too (the engine does not serve
    that route or version: not a failure of the engine).
    ``max_ejection_percent`` (50, 0..100): failed requests never leave more than this
    share of the pool's engines ejected (rounded down, but at least one engine when above
    0), and never all of them: at least one stays in rotation against failed requests
    (a pool of 1 is never ejected by them, of 2 at most 1). Failed requests are what a
    client can cause; without the floor one user's requests answered 5xx would eject every
    engine for everyone. 0: failed requests eject nothing. Failed health checks are not
    held to it (the engine's own state: they may take every engine out).
    ``checks_to_eject`` (2): consecutive failed health checks that eject it.
    ``eject_base_s`` (2) / ``eject_max_s`` (60): an ejected engine is probed after
    ``min(eject_max_s, eject_base_s * 2**(n-1))`` seconds for its n-th ejection in a row,
    with jitter (half of it random); a passed probe brings it back.
    ``check_interval_s`` (5): seconds between health checks of an engine in rotation
    (0: none; ejected engines are still probed). ``check_timeout_s`` (2): a check slower
    than this fails. ``check_path``: the ``GET`` path of a check; default ``/token_load``
    for ``lightllm`` engines (their ``/health`` is not to be trusted in 0.0.1 and runs a
    generation in later releases) and ``/v1/models`` for ``openai`` ones.
    """

    failures_to_eject: int = Field(default=3, ge=1, le=1000)
    max_ejection_percent: int = Field(default=50, ge=0, le=100)
    checks_to_eject: int = Field(default=2, ge=1, le=1000)
    eject_base_s: float = Field(default=2.0, gt=0, le=3600)
    eject_max_s: float = Field(default=60.0, gt=0, le=86400)
    check_interval_s: float = Field(default=5.0, ge=0, le=3600)
    check_timeout_s: float = Field(default=2.0, gt=0, le=600)
    check_path: str | None = Field(default=None, pattern=r"^/\S*$", max_length=256)

    @model_validator(mode="after")
    def _max_at_least_base(self) -> "HealthConfig":
        if self.eject_max_s < self.eject_base_s:
            raise ValueError(f"eject_max_s ({self.eject_max_s:g}) must be at least eject_base_s ({self.eject_base_s:g})")
        return self


class EngineConfig(_Model):
    """One engine of a pool, as written in the file. Keys left out take the pool-wide
    default named below (:func:`resolve_pools` fills them in).

    ``url``: base URL (a ``user:password@`` in it is sent as Basic auth). ``name``: a
    short name for metrics and status (default: ``url``, its ``user:password@`` shown as
    ``***@``: :func:`public_url`).
    ``kind``, ``api_key``, ``api_key_env``: as in ``upstream`` (default: ``upstream``'s).
    ``max_inflight`` / ``max_inflight_tokens``: this engine's capacity, in requests and in
    reserved tokens (default: ``admission.max_inflight`` / ``max_inflight_tokens``).
    ``weight`` (> 0, default 1): its share under ``round_robin`` and of affinity keys.
    ``load_signal``: keys of ``upstream.load_signal`` to override for this engine.
    ``priority_field``: two-level scheduling: the body field in which this engine expects
    a request priority (vLLM ``--scheduling-policy priority``, SGLang
    ``--enable-priority-scheduling``: ``priority``); the proxy writes each request's
    group rank there (:mod:`proxy.relay.engine_body`). Never sent when unset.
    ``priority_order``: ``lower_first`` (vLLM) or ``higher_first`` (SGLang's default).
    ``max_model_len``: this engine's context length in tokens (default:
    ``upstream.max_model_len``); a request to its pool reserves at most the pool's
    smallest one, minus its prompt, as output (:attr:`PoolSpec.max_model_len`).
    ``stream_usage``: ``upstream.stream_usage`` for this engine (``None``: the
    ``upstream`` section's), e.g. ``false`` for one engine that rejects ``stream_options``.
    ``server``: this engine's software (default: ``upstream.server``; see
    :class:`proxy.config.schema.UpstreamConfig`).
    """

    url: str
    name: str | None = Field(default=None, min_length=1, max_length=200)
    kind: Literal["openai", "lightllm"] | None = None
    api_key: str | None = None
    api_key_env: str | None = None
    max_inflight: int | None = Field(default=None, ge=1)
    max_inflight_tokens: int | None = Field(default=None, ge=1)
    weight: float = Field(default=1.0, gt=0, le=1000)
    load_signal: dict[str, Any] | None = None
    priority_field: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
    priority_order: Literal["lower_first", "higher_first"] = "lower_first"
    max_model_len: int | None = Field(default=None, ge=1)
    stream_usage: bool | None = None
    server: EngineServer | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return base_url(v)

    @property
    def engine_name(self) -> str:
        """``name``, or the URL when none is given (without its credential:
        :func:`public_url`)."""
        return self.name or public_url(self.url)


class PoolPreemptionConfig(_Model):
    """A pool's own preemption settings.

    ``resume`` (unset: ``admission.preemption.resume``, default false): a lower group's
    stream that has shown its client tokens may be preempted and is resumed where it
    stopped (``docs/scheduling.md``); every engine of the pool must continue a message
    (``server: vllm`` or ``sglang``, :func:`check_resume`).
    """

    resume: bool | None = None


class PoolConfig(_Model):
    """One pool: a queue of its own and the engines that serve its models.

    ``name``: unique, a metrics label (letters, digits, ``.``, ``_``, ``-``; at most 64).
    ``models``: the names clients send (see :class:`ModelEntry`). ``engines``: at least
    one. ``routing``: :class:`RoutingConfig`. ``health``: :class:`HealthConfig`.
    ``preemption``: :class:`PoolPreemptionConfig`.
    """

    name: str = Field(pattern=_POOL_NAME)
    models: list[ModelEntry] = Field(min_length=1)
    engines: list[EngineConfig] = Field(min_length=1)
    routing: RoutingConfig = RoutingConfig()
    health: HealthConfig = HealthConfig()
    preemption: PoolPreemptionConfig = PoolPreemptionConfig()

    @model_validator(mode="after")
    def _unique_inside(self) -> "PoolConfig":
        for what, values in (
            ("model names", [m.name for m in self.models]),
            ("engine urls", [public_url(e.url) for e in self.engines]),
            ("engine names", [e.engine_name for e in self.engines]),
        ):
            dup = sorted({v for v in values if values.count(v) > 1})
            if dup:
                raise ValueError(f"{what} must be unique within pool {self.name!r}, repeated: {dup}")
        return self


class PassthroughConfig(_Model):
    """Other paths under ``/v1/`` (not chat, completions, embeddings, responses, models).

    ``enabled`` (false): pass them to an engine (the pool of the body's ``model``, else the
    catch-all pool, else the only pool); off, they answer 404 as before. ``admit`` (true):
    such a request waits for admission like any other, reserving ``cost_tokens`` (1)
    tokens; false: it goes straight to an engine, outside admission and rate limits.
    """

    enabled: bool = False
    admit: bool = True
    cost_tokens: int = Field(default=1, ge=0, le=1_000_000)


# --------------------------------------------------------------- resolved form


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One engine with every default filled in: what the router and the relay use.

    Attributes:
        pool: its pool's name.
        name: its name (metrics label ``engine``; unique within the pool).
        upstream: the ``upstream`` section this engine is reached with (a
            :class:`proxy.config.schema.UpstreamConfig` whose ``url``, ``kind``, credential and
            ``load_signal`` are this engine's): pass it to :class:`proxy.relay.upstream.Upstream`
            and the load-signal poller as they are.
        max_inflight: the most requests it may run at once (>= 1): the ceiling of its
            capacity controller, or its fixed capacity.
        max_inflight_tokens: reserved tokens it may hold at once, or ``None``.
        control: its capacity controller's settings
            (:class:`qos.capacity_control.ControlSettings`), or ``None`` for a fixed
            capacity of ``max_inflight`` (``admission.capacity.mode: fixed``).
        weight: routing weight (> 0).
        priority_field, priority_order: two-level scheduling (see :class:`EngineConfig`).
    """

    pool: str
    name: str
    upstream: Any
    max_inflight: int
    max_inflight_tokens: int | None
    weight: float = 1.0
    control: Any = None
    priority_field: str | None = None
    priority_order: str = "lower_first"

    @property
    def url(self) -> str:
        """The engine's base URL."""
        return self.upstream.url

    @property
    def kind(self) -> str:
        """``openai`` or ``lightllm``."""
        return self.upstream.kind


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """One pool with every default filled in.

    Attributes:
        name: the pool's name.
        models: its model entries (``"*"`` for the catch-all).
        engines: its engines, in config order.
        routing, health: its settings.
        single_upstream: made from the single-``upstream`` form (its models list is the
            upstream's own: ``GET /v1/models`` is passed through).
        resume: its streams shown to their clients may be preempted and resumed
            (``preemption.resume``).
    """

    name: str
    models: tuple[ModelEntry, ...]
    engines: tuple[EngineSpec, ...]
    routing: RoutingConfig
    health: HealthConfig
    single_upstream: bool = False
    resume: bool = False

    @property
    def catch_all(self) -> bool:
        """Whether this pool takes every model no pool names."""
        return any(m.name == CATCH_ALL for m in self.models)

    @property
    def max_model_len(self) -> int | None:
        """The smallest context length (tokens) among this pool's engines that give one,
        or ``None``: a request is admitted before its engine is chosen (bind late), so
        its reservation must fit whichever engine of the pool gets it."""
        lens = [e.upstream.max_model_len for e in self.engines if e.upstream.max_model_len is not None]
        return min(lens) if lens else None

    def output_ceiling(self, prompt_tokens: int) -> int | None:
        """The most output tokens a request with a prompt of ``prompt_tokens`` (the
        estimate) can get from an engine of this pool: :attr:`max_model_len` minus the
        prompt, at least 1; ``None`` when no engine gives a context length."""
        n = self.max_model_len
        return None if n is None else max(1, n - max(0, prompt_tokens))


def _engine_upstream(upstream: Any, engine: EngineConfig) -> Any:
    """``upstream`` (an UpstreamConfig) with ``engine``'s url, kind, credential,
    ``max_model_len``, ``stream_usage`` and load-signal overrides. Raises ValueError for an invalid ``load_signal`` override."""
    update: dict[str, Any] = {"url": engine.url}
    if engine.kind is not None:
        update["kind"] = engine.kind
    if engine.api_key is not None or engine.api_key_env is not None:
        update["api_key"], update["api_key_env"] = engine.api_key, engine.api_key_env
    if engine.max_model_len is not None:
        update["max_model_len"] = engine.max_model_len
    if engine.stream_usage is not None:
        update["stream_usage"] = engine.stream_usage
    if engine.server is not None:
        update["server"] = engine.server
    if engine.load_signal:
        base = upstream.load_signal
        try:
            update["load_signal"] = type(base).model_validate({**base.model_dump(), **engine.load_signal})
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, x['loc'])) or '(value)'}: {x['msg']}" for x in e.errors())
            raise ValueError(f"engine {engine.engine_name!r}: load_signal: {problems}") from None
    return upstream.model_copy(update=update)


def resolve_pools(config: Any) -> tuple[PoolSpec, ...]:
    """The pools ``config`` (a :class:`proxy.config.schema.Config`) describes, defaults filled in.

    The single-upstream form gives one pool, ``default``, serving ``"*"`` with the one
    engine ``upstream`` (named by its URL), whose capacity is ``admission.max_inflight`` /
    ``max_inflight_tokens``: exactly what the proxy enforced before pools existed.

    Raises:
        ValueError: an engine's ``load_signal`` override is invalid (the config validator
            calls this, so a loaded config never raises here).
    """
    adm = config.admission
    if not config.pools:
        cap = adm.capacity
        engine = EngineSpec(
            DEFAULT_POOL, public_url(config.upstream.url), config.upstream, cap.ceiling(adm.max_inflight), adm.max_inflight_tokens,
            control=cap.settings(adm.max_inflight),
        )  # fmt: skip
        return (
            PoolSpec(DEFAULT_POOL, (ModelEntry(name=CATCH_ALL),), (engine,), RoutingConfig(), HealthConfig(), single_upstream=True, resume=adm.preemption.resume),
        )
    out = []
    for pool in config.pools:
        engines = tuple(
            EngineSpec(
                pool=pool.name,
                name=e.engine_name,
                upstream=_engine_upstream(config.upstream, e),
                max_inflight=adm.capacity.ceiling(e.max_inflight if e.max_inflight is not None else adm.max_inflight),
                control=adm.capacity.settings(e.max_inflight if e.max_inflight is not None else adm.max_inflight),
                max_inflight_tokens=e.max_inflight_tokens if e.max_inflight_tokens is not None else adm.max_inflight_tokens,
                weight=e.weight,
                priority_field=e.priority_field,
                priority_order=e.priority_order,
            )
            for e in pool.engines
        )
        resume = pool.preemption.resume if pool.preemption.resume is not None else adm.preemption.resume
        out.append(PoolSpec(pool.name, tuple(pool.models), engines, pool.routing, pool.health, resume=resume))
    return tuple(out)


def check_pools(config: Any) -> None:
    """Cross-pool rules of a :class:`proxy.config.schema.Config` (called by its validator).

    Raises:
        ValueError: pool names repeated; a model name in two pools; ``"*"`` in two pools;
            ``upstream.url`` given together with ``pools``; an invalid engine
            ``load_signal`` override. The message names the pools and models concerned.
    """
    if not config.pools:
        return
    if "url" in config.upstream.model_fields_set:
        raise ValueError(
            "give either upstream.url (one engine serving every model) or pools (each engine names its url), not both; "
            "with pools, upstream holds only the settings every engine shares"
        )
    names = [p.name for p in config.pools]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"pool names must be unique, repeated: {dup}")
    owner: dict[str, str] = {}
    for p in config.pools:
        for m in p.models:
            if m.name in owner:
                what = "the catch-all '*'" if m.name == CATCH_ALL else f"model {m.name!r}"
                raise ValueError(f"{what} is in two pools, {owner[m.name]!r} and {p.name!r}; a model belongs to one pool")
            owner[m.name] = p.name
    resolve_pools(config)  # engine load_signal overrides


def check_resume(config: Any) -> None:
    """Refuse ``preemption.resume`` for a pool with an engine that cannot continue a
    message (called by the config's validator): each engine of a resuming pool must be
    of kind ``openai`` and state ``server: vllm`` or ``sglang`` (the engines with
    ``continue_final_message``; LightLLM, transformers serve and hosted APIs have none,
    and the proxy cannot tell ``openai``-kind engines apart by themselves).

    Raises:
        ValueError: naming the pool, the engine and what it is.
    """
    for pool in resolve_pools(config):
        if not pool.resume:
            continue
        for e in pool.engines:
            server = e.upstream.server
            if e.kind == "openai" and server in RESUMING_SERVERS:
                continue
            what = "kind lightllm" if e.kind == "lightllm" else (f"server {server}" if server is not None else "no server stated")
            raise ValueError(
                f"pool {pool.name!r}: preemption.resume needs engines that continue a final assistant message "
                f"(continue_final_message: vLLM, SGLang), but engine {e.name!r} has {what}; "
                "state server: vllm or sglang for each of its engines, or turn resume off"
            )


def bundled_pool_config(config: Any, urls: list[str]) -> Any:
    """``config`` (single-upstream form) turned into one catch-all pool ``default`` over
    the engines at ``urls``: what ``llm-qos up --engines N`` and ``llm-qos proxy --upstream
    A --upstream B`` serve. Each engine shares the ``upstream`` settings (kind, credential,
    timeouts, load signal) and has the capacity ``admission.max_inflight`` /
    ``max_inflight_tokens`` that one engine had.

    Raises:
        ValueError: ``config`` already has ``pools`` (name the engines there), or ``urls``
            is empty or repeats a URL.
    """
    if config.pools:
        raise ValueError("the config has pools: list their engines there, not with --upstream")
    if not urls:
        raise ValueError("no engine URL given")
    data = config.model_dump(exclude={"upstream": {"url"}, "pools": True})
    data["pools"] = [{"name": DEFAULT_POOL, "models": [CATCH_ALL], "engines": [{"url": u} for u in urls]}]
    return type(config).model_validate(data)
