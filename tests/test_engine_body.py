"""The body an engine gets: untouched unless an alias or two-level scheduling applies, and
then a client's own priority never survives."""

from __future__ import annotations

import orjson
import pytest

from proxy.relay.engine_body import body_for_engine, priority_value


def test_group_ranks_become_each_engines_priority_values():
    # four groups, platinum first: vLLM runs lower values first, SGLang higher ones
    assert [priority_value(r, 4, "lower_first") for r in range(4)] == [0, 1, 2, 3]
    assert [priority_value(r, 4, "higher_first") for r in range(4)] == [3, 2, 1, 0]
    with pytest.raises(ValueError):
        priority_value(4, 4, "lower_first")
    with pytest.raises(ValueError):
        priority_value(0, 4, "sideways")


def test_nothing_to_change_sends_the_clients_bytes():
    raw = b'{"model":"m",  "messages":[], "priority": -100}'
    assert body_for_engine(raw, orjson.loads(raw)) is raw  # an engine without priority_field: as sent


def test_alias_and_priority_are_written_and_a_clients_priority_is_replaced():
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "priority": -100, "stream": true}'
    fields = orjson.loads(raw)
    out = orjson.loads(body_for_engine(raw, fields, "smol", ("priority", 3)))
    assert out == {**fields, "model": "smol", "priority": 3}
    assert fields["priority"] == -100  # the parsed request is not changed
    only_prio = orjson.loads(body_for_engine(raw, fields, None, ("priority", 0)))
    assert only_prio["model"] == "tiny" and only_prio["priority"] == 0
