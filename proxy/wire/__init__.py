"""What crosses the wire, as data: parsing and formatting, no I/O, no state.

* :mod:`.errors`: OpenAI-style error bodies (every error the proxy answers is built
  here), their SSE forms, and the ``Retry-After`` hint.
* :mod:`.request_body`: the fields of a chat, completion or LightLLM body that admission
  needs (stream, max tokens), and the prompt-token estimate.
* :mod:`.embeddings_body`, :mod:`.responses_body`, :mod:`.passthrough_body`: the same for
  ``/v1/embeddings``, ``/v1/responses`` and pass-through paths.
* :mod:`.prompt_prefix`: the start of a request's prompt, for engine affinity.
* :mod:`.sse`: server-sent events as engines send them, and the scanner that follows a
  stream for tokens, usage, its end and errors.
* :mod:`.usage_strip`: the usage the proxy asked for and the client did not, taken out
  of a stream again.
* :mod:`.responses_answer`: the Responses API's answers: a response's usage, and the
  scanner of its typed event stream.
* :mod:`.headers`: which headers cross the proxy in each direction, and the request id.

A bottom layer: routing's model errors, admission's retry hints, the relay and the routes
use it; it knows none of them.

May import: nothing of the proxy (only :mod:`qos`).
"""
