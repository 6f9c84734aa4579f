"""Who is asking: API key or trusted header -> (user, group).

Keys are compared by their SHA-256 digests: the configured keys are hashed once when the
config loads (or given as digests), the presented key is hashed per request, and the
lookup is by digest, so timing reveals nothing about a key's characters and the config
need never hold a key in clear.

A presented key the config does not know (``Authorization: Bearer KEY`` naming no
configured user) is refused, 401 ``invalid_api_key`` (:meth:`IdentityResolver.refusal`):
it is almost always a typo or a revoked key, and serving it silently in the default group
hides the mistake. Two cases are not a presented key: a request whose trusted identity
header (``identity.header``) names the user (the gateway in front has authenticated the
caller and may pass its own ``Authorization`` through), and any key sent to a config that
lists no key at all (the OpenAI SDKs refuse to run without *some* key, so clients send a
placeholder such as ``EMPTY``; such a proxy authenticates nobody by key).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ..config.schema import Config

ANONYMOUS = "anonymous"


@dataclass(frozen=True, slots=True)
class Identity:
    """The resolved caller.

    Attributes:
        user_id: the configured user id for a known key; the header's value for a header
            identity; ``anonymous`` otherwise (so made-up keys cannot create unbounded
            per-user state).
        group: the user's configured group, or ``None`` (the scheduler then places the
            user in the default group).
        authenticated: True when a configured API key matched.
        unknown_key: True when a Bearer key was presented that no configured user has
            (and neither exception of the module docstring applies): the request is to
            be refused (:meth:`IdentityResolver.refusal`).
    """

    user_id: str
    group: str | None
    authenticated: bool
    unknown_key: bool = False


class IdentityResolver:
    """Resolves identities under one config (rebuilt on every reload).

    Args:
        config: the validated config.
    """

    def __init__(self, config: Config) -> None:
        self._by_digest: dict[str, tuple[str, str]] = {}
        self._group_of: dict[str, str] = {}
        for g in config.groups:
            for u in g.users:
                self._group_of[u.id] = g.name
                d = u.key_digest()
                if d:
                    self._by_digest[d] = (u.id, g.name)
        header = config.identity.header
        self._header = header.lower() if header else None
        self.require_api_key = config.identity.require_api_key

    def resolve(self, headers) -> Identity:
        """Resolve the caller from request ``headers`` (a case-insensitive mapping).

        Order: a Bearer key matching a configured user; else the trusted identity header,
        if configured and present; else anonymous, with ``unknown_key`` set when a
        Bearer key was presented and the config lists keys. Never raises.
        """
        presented = False
        auth = headers.get("Authorization")
        if auth and auth[:7].lower() == "bearer ":
            key = auth[7:].strip()
            if key:
                digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()
                hit = self._by_digest.get(digest)
                if hit is not None:
                    return Identity(hit[0], hit[1], True)
                presented = bool(self._by_digest)  # no key configured: a placeholder, ignored
        if self._header:
            uid = headers.get(self._header)
            if uid:
                uid = uid.strip()[:128]
                if uid:
                    return Identity(uid, self._group_of.get(uid), False)
        return Identity(ANONYMOUS, None, False, unknown_key=presented)

    def refusal(self, ident: Identity) -> str | None:
        """The message of the 401 ``invalid_api_key`` that ``ident`` must be answered, or
        ``None`` when it may go on: a presented key no configured user has; or no known
        key while ``identity.require_api_key`` is on (a header identity included)."""
        if ident.unknown_key:
            return "the API key is not valid: no configured user has it (Authorization: Bearer KEY)"
        if self.require_api_key and not ident.authenticated:
            return "a valid API key is required (Authorization: Bearer KEY)"
        return None
