"""The operator's YAML file: its schema (the one place config keys are defined), loading,
and translation into the scheduler's :class:`qos.SchedulerPolicy`.

Validation is pydantic v2 with unknown keys forbidden, so a typo is an error that names
its key path instead of a silently ignored setting. Every default here is the documented
default (``docs/configuration.md``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from qos import CostModel, GroupPolicy, RateLimit, SchedulerPolicy, UserPolicy

PositiveFloat = Annotated[float, Field(gt=0)]


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
    """Hold new admissions while the engine reports itself saturated (:mod:`proxy.load_signal`).

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
    and assemble the answer in the proxy (:mod:`proxy.assemble`), so that a client that
    leaves a non-streaming request aborts the generation on engines that abort only
    streams (``transformers serve``).

    ``kind`` selects protocol quirks: ``openai`` (vLLM, SGLang, transformers serve, hosted
    APIs) or ``lightllm``. ``api_key`` / ``api_key_env`` is the proxy's own credential
    for the upstream; clients' keys are never forwarded. ``load_signal``: see
    :class:`LoadSignalConfig`.
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
    load_signal: LoadSignalConfig = LoadSignalConfig()

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not (v.startswith("http://") or v.startswith("https://")):
            raise ValueError("must start with http:// or https://")
        return v.rstrip("/")

    def credential(self) -> str | None:
        """The upstream API key: ``api_key``, else the variable named by ``api_key_env``."""
        return _secret(self.api_key, self.api_key_env)


class AdmissionConfig(_Model):
    """Capacity, queueing and per-user state (see :class:`qos.SchedulerPolicy`).

    ``max_users``: most users whose fair-share state is kept (users with requests queued
    or in flight always are); ``forget_users_after_s``: a user with nothing queued or in
    flight for this long is forgotten (it would be lifted to its class's virtual time
    when it returns anyway).
    """

    max_inflight: int = Field(default=8, ge=1)
    max_inflight_tokens: int | None = Field(default=None, ge=1)
    max_queue: int = Field(default=1000, ge=0)
    queue_timeout_s: PositiveFloat = 30.0
    share_window_s: PositiveFloat = 30.0
    max_users: int = Field(default=20000, ge=1)
    forget_users_after_s: PositiveFloat = 300.0


class CostConfig(_Model):
    """Token cost model for fair sharing (see :class:`qos.CostModel`) and the prompt
    estimate's per-part costs (:mod:`proxy.request_body`).

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


class GroupConfig(_Model):
    """One priority class; groups are listed highest priority first.

    ``max_tokens`` caps the output a request of this group may ask for (see
    ``limits.max_tokens_action``)."""

    name: str = Field(min_length=1)
    users: list[UserConfig] = []
    max_queue: int | None = Field(default=None, ge=0)
    min_share: float = Field(default=0.0, ge=0, le=1)
    rate_limit: RateLimitConfig = RateLimitConfig()
    default_user_weight: float = Field(default=1.0, ge=0)
    max_tokens: int | None = Field(default=None, ge=1)


class Config(_Model):
    """The whole configuration file."""

    upstream: UpstreamConfig = UpstreamConfig()
    admission: AdmissionConfig = AdmissionConfig()
    cost: CostConfig = CostConfig()
    identity: IdentityConfig = IdentityConfig()
    admin: AdminConfig = AdminConfig()
    limits: LimitsConfig = LimitsConfig()
    default_group: str
    groups: list[GroupConfig] = Field(min_length=1)

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
        return self

    def group(self, name: str) -> GroupConfig:
        """The group called ``name``. Raises KeyError."""
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)

    def to_policy(self) -> SchedulerPolicy:
        """The scheduler policy this config describes."""
        users = {
            u.id: UserPolicy(u.id, g.name, u.weight, u.rate_limit.to_policy()) for g in self.groups for u in g.users
        }
        return SchedulerPolicy(
            groups=tuple(
                GroupPolicy(g.name, g.max_queue, g.min_share, g.rate_limit.to_policy(), g.default_user_weight)
                for g in self.groups
            ),
            default_group=self.default_group,
            users=users,
            max_inflight=self.admission.max_inflight,
            max_inflight_tokens=self.admission.max_inflight_tokens,
            max_queue=self.admission.max_queue,
            queue_timeout_s=self.admission.queue_timeout_s,
            cost=CostModel(self.cost.input_weight, self.cost.output_weight, self.cost.default_max_tokens, self.cost.max_tokens_ceiling),
            share_window_s=self.admission.share_window_s,
            max_users=self.admission.max_users,
            forget_users_after_s=self.admission.forget_users_after_s,
        )


def with_upstream_url(config: Config, url: str | None) -> Config:
    """``config`` with ``upstream.url`` replaced by ``url`` (the CLI's ``--upstream``);
    unchanged when ``url`` is ``None``."""
    if not url:
        return config
    return config.model_copy(update={"upstream": config.upstream.model_copy(update={"url": url.rstrip("/")})})


class ConfigError(Exception):
    """A config file that cannot be used; the message names the file, key path and value."""


def _format_validation(path: str, err: ValidationError) -> str:
    lines = [f"{path}: {err.error_count()} error(s)"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        value = e.get("input")
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        lines.append(f"  {loc}: {e['msg']} (got {shown})")
    return "\n".join(lines)


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key repeated in one mapping (YAML allows it and
    keeps the last value, which would hide half of an operator's edit)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _value in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice in one mapping", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def parse_config(text: str, source: str = "<config>") -> Config:
    """Parse and validate YAML ``text``.

    Raises:
        ConfigError: syntax error, a key repeated in one mapping, empty document, or a
            schema violation (every error with its key path, the bad value and what is
            allowed).
    """
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from None
    if data is None:
        raise ConfigError(f"{source}: the file is empty")
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation(source, e)) from None


def load_config(path: str | Path) -> Config:
    """Read and validate the YAML file at ``path``. Raises :class:`ConfigError`."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: cannot read: {e}") from None
    return parse_config(text, str(p))


def config_digest(text: str | bytes) -> str:
    """Short SHA-256 of a config file's bytes, for ``/admin/config``."""
    if isinstance(text, str):
        text = text.encode()
    return hashlib.sha256(text).hexdigest()[:16]
