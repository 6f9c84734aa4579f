"""The Redis key layout of the shared state: every key name is made here.

All keys of one deployment start with ``{PREFIX}:`` (``shared_state.key_prefix`` in
braces). The client is a plain Redis client to one server, not a Redis Cluster client, so
a cluster is not supported; the braces would at least keep every key of a deployment in
one hash slot (a cluster hashes only the part in braces), as multi-key scripts need there.

=================================  ======  ==========================================================
key                                type    content
=================================  ======  ==========================================================
``{P}:replicas``                   zset    replica id -> lease expiry (Redis ``TIME``, ms)
``{P}:epoch``                      hash    ``rebuild_until`` (ms): the end of the rebuild window
``{P}:lease:<capacity key>``       hash    replica id -> JSON ``{a, g, f, c, d}``: applied grant, issued
                                           grant, in flight, capacity, demand per class
``{P}:replica:<replica id>``       hash    ``svc_seq``, ``rl_seq``: last batch of deltas applied
``{P}:rsv:<replica id>``           zset    the replica's reserves Redis took and it may not have heard
                                           of (member = score = reserve number), written-off ones
                                           (``x<n>``), and ``floor`` (every number below is settled)
``{P}:rl:user:<user id>``          hash    ``r``, ``t`` (request and token bucket levels), ``ts`` (ms)
``{P}:rl:group:<group>``           hash    the same, for a whole group
``{P}:svc:<len>:<pool>:<user id>`` string  the user's service in the pool (cost units, float)
=================================  ======  ==========================================================

Every key carries a PEXPIRE: leases and replica hashes live ``keep`` (10 lease times, at
least a minute) past their last write, a bucket until it would be full again, a service
counter ``service_ttl_s`` past its last use. So the key space is bounded by what was
active recently, whatever clients send. User ids are stored as given (Redis keys are
binary-safe); the pool name is length-prefixed so no pool/user pair can collide.
"""

from __future__ import annotations


class Keys:
    """Key names for one ``key_prefix``.

    Args:
        prefix: ``shared_state.key_prefix`` (no braces; validated by the config).
    """

    __slots__ = ("base", "replicas", "epoch")

    def __init__(self, prefix: str) -> None:
        self.base = "{" + prefix + "}"
        self.replicas = self.base + ":replicas"
        self.epoch = self.base + ":epoch"

    def lease(self, capacity_key: str) -> str:
        """The lease hash of one capacity key (an engine's slots, its tokens, ...)."""
        return f"{self.base}:lease:{capacity_key}"

    def replica(self, replica_id: str) -> str:
        """The per-replica hash (sequence numbers of applied delta batches)."""
        return f"{self.base}:replica:{replica_id}"

    def reserve_log(self, replica_id: str) -> str:
        """The per-replica log of reserves (:class:`proxy.shared.reserve_log.ReserveLog`)."""
        return f"{self.base}:rsv:{replica_id}"

    def user_bucket(self, user_id: str) -> str:
        """A user's rate-limit buckets."""
        return f"{self.base}:rl:user:{user_id}"

    def group_bucket(self, group: str) -> str:
        """A group's rate-limit buckets."""
        return f"{self.base}:rl:group:{group}"

    def service(self, pool: str, user_id: str) -> str:
        """A user's service counter in one pool."""
        return f"{self.base}:svc:{len(pool)}:{pool}:{user_id}"
