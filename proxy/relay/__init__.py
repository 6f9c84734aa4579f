"""The exchange with an engine: what it is sent, the connection, and the answer relayed
back to the client.

* :mod:`.request_kinds`: the kinds of request, one per route: which parser reads each body
  for admission (:mod:`proxy.wire`) and which scanner reads its answer (a
  :class:`~.relay.StreamScanner` for the relay beside it).
* :mod:`.engine_body`: what one engine is sent: an alias's model name, the request's
  priority for engines that schedule by priority.
* :mod:`.upstream_body`: the proxy's own additions to a body (usage in streams, a
  non-streaming request sent as a stream), and opening a request with the retry
  without them.
* :mod:`.upstream`: the connections to the engines and opening a request on one.
* :mod:`.relay`: relaying an answer to the client, streamed or whole, counting its
  tokens and telling how it ended.
* :mod:`.assemble`: a non-streaming answer rebuilt from the engine's stream.
* :mod:`.answer`: which of those an engine's answer takes to the client (bytes, a
  stream, assembled, a body).

The relay does not choose the engine nor decide who goes (routing, admission): the
routes hand it the engine the router chose.

May import: config, wire, telemetry.
"""
