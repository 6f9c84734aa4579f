"""Reading the operator's config: the YAML file (or text) into a validated
:class:`proxy.config.schema.Config`, the command line's ``--upstream`` applied to it, and
the digest a reload compares.

Every error is a :class:`ConfigError` whose message names the file, the key path, the
value and what is allowed, and never quotes a secret (:data:`proxy.config.schema.SECRET_FIELDS`,
a URL's ``user:password@``, the snippet of the file PyYAML would quote).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import yaml
from pydantic import ValidationError

from .pools import bundled_pool_config
from .schema import SECRET_FIELDS, Config, UpstreamConfig


class ConfigError(Exception):
    """A config file that cannot be used; the message names the file, key path and value
    (a secret's value never: only its type, see :data:`SECRET_FIELDS`)."""


_USERINFO = re.compile(r"(?<=://)[^/@\s]*@")  # the user:password@ of a URL


def _a(value: object) -> str:
    """``value``'s type, as a config error names it ("a list", "an int")."""
    name = {dict: "mapping", list: "list", str: "string", bool: "boolean", int: "int", float: "float"}.get(type(value), type(value).__name__)
    return ("an " if name[0] in "aeiou" else "a ") + name


def _shown(loc: tuple, value: object, err_type: str) -> str | None:
    """What a config error says it got, never a secret: only the type of a value under
    a secret key (:data:`SECRET_FIELDS`), of a list or mapping (it may hold one), or of
    a string under an unknown key (a misspelt ``api_key``); a URL's ``user:password@``
    as ``***@``. ``None``: nothing worth saying (a validator's verdict on a section)."""
    if any(p in SECRET_FIELDS for p in loc if isinstance(p, str)):
        return _a(value)
    if isinstance(value, dict):
        return None if err_type in ("value_error", "assertion_error") else _a(value)
    if isinstance(value, (list, tuple, set)):
        return _a(value)
    if isinstance(value, str):
        if err_type == "extra_forbidden":
            return _a(value)
        if loc and loc[-1] == "url" and "@" in value:  # redis//user:password@host: no "://" to go by
            head, _, host = value.rpartition("@")
            value = (head.partition("://")[0] + "://" if "://" in head else "") + "***@" + host
        shown = repr(_USERINFO.sub("***@", value))
    else:
        shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


def _format_validation(path: str, err: ValidationError) -> str:
    lines = [f"{path}: {err.error_count()} error(s)"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        shown = _shown(tuple(e["loc"]), e.get("input"), e["type"])
        lines.append(f"  {loc}: {e['msg']}" + (f" (got {shown})" if shown is not None else ""))
    return "\n".join(lines)


def _yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error's problem and where (line, column), without the snippet of the file
    PyYAML quotes, which may hold a secret (``api_key: "sk-...`` with its quote unclosed)."""
    if not isinstance(err, yaml.MarkedYAMLError):
        return str(err)

    def at(mark) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""

    problem = err.problem or "invalid YAML"
    where = at(err.problem_mark)
    text = f"{problem} at {where}" if where else problem
    if err.context:
        ctx_at = at(err.context_mark)
        text += f" ({err.context} started at {ctx_at})" if ctx_at and ctx_at != where else f" ({err.context})"
    if err.note:
        text += f"; {err.note}"
    return text


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
        raise ConfigError(f"{source}: not valid YAML: {_yaml_problem(e)}") from None
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


def with_upstream_url(config: Config, url: str | None) -> Config:
    """``config`` with ``upstream.url`` replaced by ``url`` (the CLI's ``--upstream``);
    unchanged when ``url`` is ``None``.

    Raises:
        ConfigError: ``url`` is not a valid ``upstream.url``.
    """
    if not url:
        return config
    try:
        upstream = UpstreamConfig.model_validate({**config.upstream.model_dump(), "url": url})
    except ValidationError as e:
        raise ConfigError(_format_validation("--upstream", e)) from None
    return config.model_copy(update={"upstream": upstream})


def with_upstream_urls(config: Config, urls: str | list[str] | None) -> Config:
    """``config`` with the CLI's ``--upstream`` applied: none, or one URL, as
    :func:`with_upstream_url`; several URLs make one catch-all pool over those engines
    (:func:`proxy.config.pools.bundled_pool_config`).

    Raises:
        ConfigError: ``--upstream`` given for a config with ``pools``, or a URL repeated.
    """
    if urls is None or isinstance(urls, str):
        urls = [urls] if urls else []
    if not urls:
        return config
    if config.pools:
        raise ConfigError("--upstream replaces the upstream section's url; this config has pools: name the engines there")
    if len(urls) == 1:
        return with_upstream_url(config, urls[0])
    try:
        return bundled_pool_config(config, [u.rstrip("/") for u in urls])
    except ValidationError as e:
        raise ConfigError(_format_validation("--upstream", e)) from None
