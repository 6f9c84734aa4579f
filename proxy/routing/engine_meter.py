"""What the proxy measures of its own requests on one engine: time to first token and
time per output token, the latency half of the capacity controller's input
(:mod:`qos.capacity_control`).

Fed from the request path: :meth:`EngineMeter.progress` with each request's cumulative
output count as its stream advances (the relay's progress callback), :meth:`finished`
when it ends. Read once per control step with :meth:`sample`:

* **time to first token** (TTFT): from dispatch (the ticket's ``admitted_at``) to the
  first output token, one sample per request whose first token came since the last step;
  of those, the classes (:attr:`qos.Ticket.headroom`) of requests whose first token
  came later than their class's TTFT objective (:attr:`qos.Ticket.ttft_target_s`): the
  engine runs more than those classes can afford, and
  the classes below them leave more of it free (:meth:`qos.capacity.RecentPeaks.late`).
  Not judged: a resumed stream's later parts (its client's first token came in the
  first part) and a request moved here from another engine before it reached it (its
  time since dispatch includes the other engine's failure);
* **time per output token** (TPOT) of a stream over the last step: the time from its last
  token before the step to its last token in it, divided by the tokens it produced in
  between, for a stream that was there for the whole step (a burst of tokens delivered
  together cannot make it look fast: what counts is how many came and when the last of
  them came, not their spacing; and from token to token, not the step's length divided
  by a whole number of tokens, which on a slow engine, two to four tokens a stream per
  step, read 0.125, 0.167 or 0.25 s and nothing between); the step's figure is the
  **median** over the streams there all step long. One that produced no token in the
  whole step counts with the time since its last token, a lower bound of its next one: on
  an engine whose batch steps outlast the interval (vLLM's CPU build at 64 streams on an
  AVX2 host: about 2.5 s a step) most steps see no stream advance, and counting only those
  that did left most steps without a median while the limit grew through them. A median
  is moved by no minority of streams, so a few clients that read slowly, stop reading or
  send huge prompts cannot make every stream look slow; clients holding most of the
  engine's streams that stop reading can, and the latency floor
  (:mod:`qos.capacity_control`, rule 2) bounds what that takes from the others.

Memory is one small entry per request in flight on the engine, dropped when it ends (or at
the next step, for one whose end was never reported).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qos import TicketState


@dataclass(slots=True)
class _Stream:
    n: int  # output tokens so far
    last_at: float  # clock reading of the last advance
    n_step: int  # output tokens at the last step
    last_at_step: float  # last_at at the last step
    stepped: bool = False  # n_step and last_at_step were taken at a step (not at its first token)


@dataclass(frozen=True, slots=True)
class MeterSample:
    """One control step's measurements of an engine.

    Attributes:
        tpot_s: median seconds per output token of the streams there all step long, or ``None``.
        streams: how many streams that median is over.
        ttft_s: times to first token (seconds) of the requests whose first token came.
        answered: requests that showed their first token, or ended without one (a
            non-streaming answer, a failure), since the last step: the controller's
            acknowledgements (:attr:`qos.capacity_control.Observation.answered`).
        awaiting: streams placed here that have not shown their first token yet (only
            streams say when their first token comes; a non-streaming request is silent
            until it ends).
        late_levels: the headrooms (:attr:`qos.Ticket.headroom`) of the classes whose
            first token came later than their TTFT objective after dispatch, since the
            last step (the module docstring says which are not judged).
    """

    tpot_s: float | None
    streams: int
    ttft_s: tuple[float, ...]
    answered: int = 0
    awaiting: int = 0
    late_levels: frozenset[float] = frozenset()


class EngineMeter:
    """The latency measurements of one engine (see the module docstring)."""

    __slots__ = ("_streams", "_ttft", "_sampled_at", "_ended", "_answered", "_awaiting", "_late_levels", "_unjudged")

    def __init__(self) -> None:
        self._streams: dict[Any, _Stream] = {}
        self._awaiting: set[Any] = set()  # streams placed here without a first token yet
        self._answered = 0  # first tokens, and ends without one, since the last step
        self._ttft: list[float] = []
        self._sampled_at: float | None = None
        self._ended: list[float] = []  # per-token times of streams that ended since the last step
        self._late_levels: set[float] = set()  # classes (headrooms) with a first token later than their objective
        self._unjudged: set[Any] = set()  # moved here from another engine before a first token: not judged

    def moved(self, ticket: Any) -> None:
        """``ticket`` was moved here from another engine before it reached that one (a
        reroute): its first token here is timed, not judged against its objective."""
        if ticket not in self._streams:
            self._unjudged.add(ticket)

    def awaiting(self, ticket: Any) -> None:
        """``ticket``, placed here, is a stream: its first token is awaited."""
        if ticket not in self._streams:
            self._awaiting.add(ticket)

    def progress(self, ticket: Any, output_tokens: int, now: float) -> None:
        """``ticket`` (a :class:`qos.Ticket`) has produced ``output_tokens`` so far."""
        st = self._streams.get(ticket)
        if st is None:
            if output_tokens <= 0:
                return
            self._answered += 1
            self._awaiting.discard(ticket)
            admitted = ticket.admitted_at
            if admitted is not None:
                ttft = max(0.0, now - admitted)
                if len(self._ttft) < 4096:
                    self._ttft.append(ttft)
                target = ticket.ttft_target_s
                if target is not None and ttft > target and not ticket.resuming and not (self._unjudged and ticket in self._unjudged):
                    self._late_levels.add(ticket.headroom)
            self._unjudged.discard(ticket)
            self._streams[ticket] = _Stream(output_tokens, now, output_tokens, now)
        elif output_tokens > st.n:
            st.n, st.last_at = output_tokens, now

    def finished(self, ticket: Any) -> None:
        """``ticket`` ended (released, requeued or moved): forget it. Its tokens since the
        last step count in the next step's median, timed from its last token before that
        step (so a stream shorter than two steps, an unloaded engine's probe of 16 tokens
        at 0.05 s, is measured too: without it an idle engine's per-token time, the
        latency bound's baseline, was never seen before the first load came)."""
        st = self._streams.pop(ticket, None)
        self._awaiting.discard(ticket)
        self._unjudged.discard(ticket)
        if st is None:
            self._answered += 1  # ended without a first token: a non-streaming answer, a failure
        elif st.stepped and st.n > st.n_step and len(self._ended) < 4096:
            self._ended.append(max(0.0, st.last_at - st.last_at_step) / (st.n - st.n_step))

    def sample(self, now: float) -> MeterSample:
        """The measurements since the last call at clock reading ``now`` (and start the
        next interval)."""
        rates: list[float] = []
        gone = []
        since, self._sampled_at = self._sampled_at, now
        span = None if since is None else now - since
        for ticket, st in self._streams.items():
            if ticket.state is not TicketState.ADMITTED:
                gone.append(ticket)
                continue
            whole = span is not None and span > 0 and st.last_at_step <= since  # there all step long
            if st.n > st.n_step and whole:
                rates.append(max(0.0, st.last_at - st.last_at_step) / (st.n - st.n_step))
            elif whole and st.stepped:
                # no token all step long: its next token is at least this far off (an
                # engine whose batch steps outlast the interval shows most streams so)
                rates.append(now - st.last_at)
            st.n_step, st.last_at_step, st.stepped = st.n, min(st.last_at, now), True
        for ticket in gone:
            del self._streams[ticket]
        rates += self._ended
        self._ended = []
        ttft, self._ttft = tuple(self._ttft), []
        answered, self._answered = self._answered, 0
        late_levels, self._late_levels = frozenset(self._late_levels), set()
        if self._unjudged:
            self._unjudged = {t for t in self._unjudged if t.state is TicketState.ADMITTED}  # an end never reported
        self._awaiting = {t for t in self._awaiting if t.state is TicketState.ADMITTED}  # an end never reported
        awaiting = len(self._awaiting)
        if not rates:
            return MeterSample(None, 0, ttft, answered, awaiting, late_levels)
        rates.sort()
        mid = len(rates) // 2
        median = rates[mid] if len(rates) % 2 else 0.5 * (rates[mid - 1] + rates[mid])
        return MeterSample(median, len(rates), ttft, answered, awaiting, late_levels)

    @property
    def streams(self) -> int:
        """Requests with output on this engine now."""
        return len(self._streams)
