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

Client request → upstream: only ``X-Request-Id`` (below). The proxy sends its own
``Authorization``, ``Content-Type``, ``Accept`` and ``Accept-Encoding: identity``;
clients' keys, cookies and other headers never reach the engine.

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

REQUEST_ID = "X-Request-Id"
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


def client_headers(upstream: Mapping[str, str], request_id: str) -> CIMultiDict[str]:
    """The upstream response's headers to send to the client (see the module docstring),
    with ``X-Request-Id`` set to ``request_id`` unless the engine sent its own.

    Args:
        upstream: the upstream response's headers (a case-insensitive multidict).
        request_id: the request's id.
    """
    named = upstream.get("Connection")
    extra = {t.strip().lower() for t in named.split(",")} if named else ()
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in upstream.items():
        lk = k.lower()
        if lk in _DROPPED or lk.startswith(_DROPPED_PREFIXES) or lk in extra:
            continue
        out.add(k, v)
    if REQUEST_ID not in out:
        out[REQUEST_ID] = request_id
    return out


def content_coding(upstream: Mapping[str, str]) -> str:
    """The upstream response's ``Content-Encoding``, lower-cased ("" when none)."""
    return upstream.get("Content-Encoding", "").strip().lower()
