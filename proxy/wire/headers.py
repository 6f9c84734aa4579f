"""Which headers cross the proxy, in each direction, and the request id.

Upstream response → client: every end-to-end header passes (retry and rate-limit hints
such as ``Retry-After``, ``retry-after-ms``, ``x-should-retry``, ``x-ratelimit-*``,
``anthropic-ratelimit-*``; request ids; ``openai-*`` processing headers; content type;
vendor headers), except:

* hop-by-hop headers (RFC 9110 §7.6.1): ``Connection`` and every header it names,
  ``Keep-Alive``, ``Proxy-Connection``, ``Transfer-Encoding``, ``TE``, ``Trailer``,
  ``Upgrade``, ``Proxy-*``: they describe the proxy↔engine connection;
* ``Content-Length`` and ``Content-Encoding``: the proxy frames (and, when the engine
  compressed anyway, decodes) the body itself and sets its own;
* ``Server`` and ``Date``: the proxy's own;
* ``Set-Cookie`` / ``Set-Cookie2``: the upstream connection is shared by every user, so
  a cookie the engine (or a CDN in front of a hosted API) sets is the proxy's session,
  not the client's; handing it to one client would give it to everyone;
* ``Alt-Svc``, ``Strict-Transport-Security``: they describe the engine's own host and
  transport, not the proxy's;
* ``WWW-Authenticate``: a challenge for the proxy's credential (clients' keys are never
  forwarded), which a client cannot answer;
* ``Access-Control-*``: cross-origin policy is the proxy's decision, not the engine's.

Two are rewritten, because they describe something the proxy changed:

* ``Location`` / ``Content-Location`` (a redirect, a created resource): a URL under the
  engine's base URL names the engine's internal host; it becomes the same path relative
  to the proxy (``http://engine:8000/v1/x`` behind base ``http://engine:8000`` becomes
  ``/v1/x``, which the client resolves against the proxy's URL, through any load
  balancer in front), as nginx's ``proxy_redirect default`` does. One on the engine's
  host but outside its base URL (another path, port or scheme) has no proxy URL and is
  dropped; one on another host
  (a hosted API's CDN) passes unchanged. 3xx answers pass as they are otherwise (the
  proxy follows no redirect: the client decides, as it would talking to the engine);
* validators of the body bytes, when the proxy changed those bytes (decoded a
  ``Content-Encoding``, or relays a stream to which it may add ``[DONE]`` or from which
  it removes the usage it asked for): a strong ``ETag`` is weakened (``W/"..."``: the
  content is equivalent, not byte-identical; nginx's gzip weakens them too), and
  ``Content-MD5``, ``Content-Digest``, ``Repr-Digest`` and ``Digest``, which are digests
  of the encoded bytes (RFC 9530), are dropped. An assembled answer
  (:mod:`proxy.relay.assemble`) drops ``ETag`` too: it is another representation.

Client request → upstream: only ``X-Request-Id`` (below) and the W3C trace context,
``traceparent``, ``tracestate`` and ``baggage``, as the client sent them, so an engine
that traces (vLLM ``--otlp-traces-endpoint``) joins the client's trace. The proxy sends
its own ``Authorization``, ``Content-Type``, ``Accept`` and ``Accept-Encoding:
identity``; clients' keys, cookies and other headers never reach the engine.

Request id: a client's ``X-Request-Id`` of 1-128 characters from ``[A-Za-z0-9._:+/=@-]``
is kept, any other value is replaced by a fresh one (32 hex digits). It is sent upstream
as ``X-Request-Id`` (vLLM, SGLang and TGI adopt it), logged, and returned. When the
engine answers with an ``X-Request-Id`` of its own (a hosted API's id), the client gets
the engine's (what it would get talking to the engine directly, and what the engine's
operator can look up) and the access log records both.
"""

from __future__ import annotations

import os
import re
from typing import Mapping

from multidict import CIMultiDict
from yarl import URL

REQUEST_ID = "X-Request-Id"
#: W3C Trace Context (``traceparent``, ``tracestate``) and W3C Baggage: passed upstream.
TRACE_HEADERS = ("traceparent", "tracestate", "baggage")
_LOCATIONS = frozenset({"location", "content-location"})
# digests of the content bytes as the upstream sent them (RFC 9530; Content-MD5, RFC 1864;
# Digest, RFC 3230): wrong once the proxy has decoded or changed those bytes
_DIGESTS = frozenset({"content-md5", "content-digest", "repr-digest", "digest"})
_IDENTITY = frozenset({"", "identity"})
_SAFE_ID = re.compile(r"[A-Za-z0-9._:+/=@-]{1,128}")

_DROPPED = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "content-length",
        "content-encoding",
        "server",
        "date",
        "set-cookie",
        "set-cookie2",
        "alt-svc",
        "strict-transport-security",
        "www-authenticate",
    }
)
_DROPPED_PREFIXES = ("proxy-", "access-control-")
# codings the upstream client decodes (aiohttp: gzip and deflate always; br and zstd when
# their decoder libraries are installed, else it fails the response, answered 502)
DECODED_CODINGS = frozenset({"", "identity", "gzip", "deflate", "br", "zstd"})


def request_id_of(headers: Mapping[str, str]) -> str:
    """The client's ``X-Request-Id`` if it is 1-128 safe characters, else a new id
    (32 hex digits from the OS's random source)."""
    rid = headers.get(REQUEST_ID)
    if rid is not None and _SAFE_ID.fullmatch(rid):
        return rid
    return os.urandom(16).hex()


def client_headers(upstream: Mapping[str, str], request_id: str, base_url: str | None = None, transformed: bool = False) -> CIMultiDict[str]:
    """The upstream response's headers to send to the client (see the module docstring),
    with ``X-Request-Id`` set to ``request_id`` unless the engine sent its own.

    Args:
        upstream: the upstream response's headers (a case-insensitive multidict).
        request_id: the request's id.
        base_url: the engine's base URL: a ``Location`` under it is made relative to the
            proxy (``None``: passed as is).
        transformed: the proxy may change the body's bytes (a stream it adds to or strips):
            validators of those bytes go, as when it decoded a ``Content-Encoding``.
    """
    named = upstream.get("Connection")
    extra = {t.strip().lower() for t in named.split(",")} if named else ()
    changed = transformed or content_coding(upstream) not in _IDENTITY
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in upstream.items():
        lk = k.lower()
        if lk in _DROPPED or lk.startswith(_DROPPED_PREFIXES) or lk in extra:
            continue
        if lk in _LOCATIONS and base_url is not None:
            v = proxied_location(v, base_url)
            if v is None:
                continue
        elif changed:
            if lk in _DIGESTS:
                continue
            if lk == "etag":
                v = weak_etag(v)
        out.add(k, v)
    if REQUEST_ID not in out:
        out[REQUEST_ID] = request_id
    return out


def weak_etag(value: str) -> str:
    """``value`` as a weak entity tag (RFC 9110 §8.8.3): ``"x"`` becomes ``W/"x"``."""
    v = value.strip()
    return v if v.startswith("W/") or not v else "W/" + v


def proxied_location(value: str, base_url: str) -> str | None:
    """A ``Location`` the engine sent, as the client must get it (see the module
    docstring): under ``base_url``, the rest as a path relative to the proxy; on the
    engine's host but outside ``base_url`` (another path, port or scheme), ``None``
    (dropped); else unchanged (a relative reference already resolves against the proxy;
    another host is not the engine's)."""
    try:
        loc = URL(value.strip(), encoded=True)
        base = URL(base_url, encoded=True)
    except ValueError:
        return value
    if not loc.is_absolute() or loc.scheme.lower() not in ("http", "https"):
        return value
    if (loc.host or "").lower() != (base.host or "").lower():
        return value
    if (loc.scheme.lower(), loc.port) != (base.scheme.lower(), base.port):
        return None  # the engine's host, another service on it: no proxy URL for it
    prefix = base.raw_path.rstrip("/")
    path = loc.raw_path
    if prefix and path != prefix and not path.startswith(prefix + "/"):
        return None
    rest = path[len(prefix) :] or "/"
    if loc.raw_query_string:
        rest += "?" + loc.raw_query_string
    if loc.raw_fragment:
        rest += "#" + loc.raw_fragment
    return rest


def trace_headers(client: Mapping[str, str]) -> dict[str, str]:
    """The client's W3C trace context and baggage (:data:`TRACE_HEADERS`), to send
    upstream as they came (a header sent several times joined with ``,``, as both
    specifications allow)."""
    out = {}
    for name in TRACE_HEADERS:
        values = client.getall(name, ()) if hasattr(client, "getall") else ([client[name]] if name in client else [])
        if values:
            out[name] = ",".join(values)
    return out


def content_coding(upstream: Mapping[str, str]) -> str:
    """The upstream response's ``Content-Encoding``, lower-cased ("" when none)."""
    return upstream.get("Content-Encoding", "").strip().lower()


def origin_form(raw_target: str) -> tuple[str, str]:
    """A request target (``request.raw_path``) as ``(path, query)`` in origin form,
    both still percent-encoded as the client sent them (a parsed URL would decode
    ``%2F`` and the like): an absolute-form target (``GET http://host/v1/x``, RFC 9112
    §3.2.2) loses its scheme and authority, which name no engine of ours."""
    target = raw_target
    if not target.startswith("/"):
        rest = target.partition("://")[2]
        i = rest.find("/")
        target = rest[i:] if i >= 0 else "/"
    path, _, query = target.partition("?")
    return path, query
