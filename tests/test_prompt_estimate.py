"""The prompt estimate counts everything that becomes prompt tokens (proxy/wire/request_body.py),
and the output multiplier; parsing stays bounded on hostile bodies."""

from __future__ import annotations

import orjson
import pytest

from proxy.config.loading import parse_config
from proxy.wire.request_body import (
    MESSAGE_OVERHEAD_TOKENS,
    BadRequest,
    DefaultPromptCosts,
    cap_max_tokens,
    parse_chat,
    parse_completion,
    parse_generate,
)


def chat(**fields) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body.update(fields)
    return orjson.dumps(body)


BASE = parse_chat(chat()).prompt_tokens  # "hi" + one message's overhead


def test_text_everywhere_in_messages_is_counted():
    msgs = [
        {"role": "system", "content": "s" * 400},
        {"role": "user", "content": [{"type": "text", "text": "u" * 400}, {"type": "text", "text": "v" * 400}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "a" * 4000}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "lookup", "content": "r" * 400},
    ]
    p = parse_chat(orjson.dumps({"messages": msgs}))
    text = 400 * 4 + 4000  # the contents and the tool call's arguments
    assert text // 4 <= p.prompt_tokens - 4 * MESSAGE_OVERHEAD_TOKENS <= text // 4 + 40  # + ids, names, JSON punctuation


@pytest.mark.parametrize(
    "field, value",
    [
        ("tools", [{"type": "function", "function": {"name": "f", "description": "d" * 20_000, "parameters": {"type": "object"}}}]),
        ("functions", [{"name": "f", "description": "d" * 20_000}]),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "s", "schema": {"description": "d" * 20_000}}}),
        ("tool_choice", {"type": "function", "function": {"name": "f" * 20_000}}),
    ],
)
def test_fields_a_template_renders_into_the_prompt_are_counted(field, value):
    p = parse_chat(chat(**{field: value}))
    assert 5000 <= p.prompt_tokens - BASE <= 5100


def test_images_and_media_parts_cost_their_configured_tokens():
    parts = [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
        {"type": "input_image", "image_url": "data:image/png;base64," + "A" * 100_000},
        {"type": "input_audio", "input_audio": {"data": "B" * 100_000, "format": "wav"}},
        {"type": "file", "file": {"file_data": "C" * 100_000}},
    ]
    body = orjson.dumps({"messages": [{"role": "user", "content": parts}]})
    p = parse_chat(body)
    assert p.prompt_tokens == 2 * 1024 + 2 * 1024 + MESSAGE_OVERHEAD_TOKENS  # a base64 blob is not its length in tokens
    p = parse_chat(body, DefaultPromptCosts(image_tokens=300, media_tokens=50))
    assert p.prompt_tokens == 2 * 300 + 2 * 50 + MESSAGE_OVERHEAD_TOKENS


def test_config_keys_feed_the_estimate():
    cfg = parse_config("default_group: g\ngroups: [{name: g}]\ncost: {image_tokens: 77, media_tokens: 5, max_tokens_ceiling: 4096}\n")
    body = orjson.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert parse_chat(body, cfg.cost).prompt_tokens == 77 + MESSAGE_OVERHEAD_TOKENS
    assert cfg.to_policy().cost.max_tokens_ceiling == 4096
    assert cfg.admission.max_users == 20000 and cfg.admission.forget_users_after_s == 300


def test_n_multiplies_the_output_and_must_be_a_positive_integer():
    assert parse_chat(chat(n=4)).choices == 4
    assert parse_chat(chat()).choices == 1
    for bad in (0, -1, "3", 1.5, True):
        with pytest.raises(BadRequest) as e:
            parse_chat(chat(n=bad))
        assert e.value.param == "n"


def test_completion_prompts_strings_lists_and_token_ids():
    assert parse_completion(orjson.dumps({"prompt": "x" * 400})).prompt_tokens == 100
    ids = parse_completion(orjson.dumps({"prompt": list(range(3000))}))
    assert ids.prompt_tokens == 3000 and ids.choices == 1  # ids are tokens, one prompt
    batch = parse_completion(orjson.dumps({"prompt": ["x" * 400, "y" * 400, "z" * 400], "n": 2}))
    assert batch.prompt_tokens == 300 and batch.choices == 6  # three prompts, two choices each
    lists = parse_completion(orjson.dumps({"prompt": [[1] * 1000, [2] * 500], "best_of": 3, "n": 2}))
    assert lists.prompt_tokens == 1500 and lists.choices == 6
    suffix = parse_completion(orjson.dumps({"prompt": "x", "suffix": "s" * 4000}))
    assert suffix.prompt_tokens == 1001
    with pytest.raises(BadRequest):
        parse_completion(orjson.dumps({"prompt": [[1, 2], "mixed"]}))
    with pytest.raises(BadRequest):
        parse_completion(orjson.dumps({"prompt": "x", "best_of": 0}))


def test_native_generate_counts_best_of():
    p = parse_generate(orjson.dumps({"inputs": "x" * 40, "parameters": {"max_new_tokens": 8, "best_of": 3}}), True)
    assert p.prompt_tokens == 10 and p.choices == 3 and p.max_tokens == 8


def test_deep_nesting_is_counted_without_recursion_and_json_depth_is_bounded():
    # 600 levels: deeper than orjson serializes (254), within what it parses (1024);
    # the hidden text is still counted
    body = b'{"messages":[{"role":"user","content":"hi"}],"tools":' + b"[" * 600 + b'"' + b"z" * 40_000 + b'"' + b"]" * 600 + b"}"
    assert parse_chat(body).prompt_tokens - BASE >= 10_000
    # beyond the parser's own limit: a 400, not a crash
    bomb = b'{"messages":[{"role":"user","content":"hi"}],"tools":' + b"[" * 5000 + b"]" * 5000 + b"}"
    with pytest.raises(BadRequest):
        parse_chat(bomb)


def test_a_part_is_known_by_its_type_first():
    # an image or media part that also carries "text": "" costs its image, not 0
    parts = [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}, "text": ""},
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "text": ""},
        {"type": "input_audio", "input_audio": {"data": "B" * 1000, "format": "wav"}, "text": ""},
    ]
    p = parse_chat(orjson.dumps({"messages": [{"role": "user", "content": parts}]}), DefaultPromptCosts(image_tokens=300, media_tokens=50))
    assert p.prompt_tokens == 2 * 300 + 50 + MESSAGE_OVERHEAD_TOKENS
    # a text part is still its text
    text = parse_chat(orjson.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "t" * 400}]}]}))
    assert text.prompt_tokens == 100 + MESSAGE_OVERHEAD_TOKENS


@pytest.mark.parametrize(
    "field, value",
    [
        ("documents", [{"title": "t", "text": "d" * 20_000}]),
        ("chat_template", "{% for m in messages %}" + "x" * 20_000 + "{% endfor %}"),
        ("chat_template_kwargs", {"context": "c" * 20_000}),
    ],
)
def test_vllm_chat_extras_that_end_up_in_the_prompt_are_counted(field, value):
    p = parse_chat(chat(**{field: value}))
    assert 5000 <= p.prompt_tokens - BASE <= 5100


def test_chat_best_of_multiplies_the_output_too():
    assert parse_chat(chat(best_of=3)).choices == 3
    assert parse_chat(chat(n=2, best_of=5)).choices == 5
    assert parse_chat(chat(n=4, best_of=2)).choices == 4
    with pytest.raises(BadRequest) as e:
        parse_chat(chat(best_of=0))
    assert e.value.param == "best_of"


def test_native_generate_counts_multimodal_images():
    costs = DefaultPromptCosts(image_tokens=300, media_tokens=50)
    images = [{"type": "url", "data": "https://example.com/cat.png"}, {"type": "base64", "data": "A" * 100_000}]
    body = {"inputs": "x" * 40, "parameters": {"max_new_tokens": 8}, "multimodal_params": {"images": images}}
    p = parse_generate(orjson.dumps(body), False, costs)
    assert p.prompt_tokens == 10 + 2 * 300  # a base64 blob is not its length in tokens
    assert parse_generate(orjson.dumps(body), False).prompt_tokens == 10 + 2 * 1024  # the documented default
    body["multimodal_params"]["audios"] = [{"type": "url", "data": "https://example.com/a.wav"}]
    assert parse_generate(orjson.dumps(body), False, costs).prompt_tokens == 10 + 2 * 300 + 50
    # malformed or absent: nothing more (LightLLM refuses a malformed one itself)
    for mm in ({"images": "x"}, "x", None, {}):
        b = {"inputs": "x" * 40, "parameters": {}, "multimodal_params": mm}
        assert parse_generate(orjson.dumps(b), False, costs).prompt_tokens == 10


# ------------------------------------------------------------- a group's max_tokens cap


def _capped(body: dict, cap: int = 64, reject: bool = False):
    p = cap_max_tokens(parse_chat(chat(**body)), cap, reject)
    return p, orjson.loads(p.body)


def test_a_group_cap_never_raises_a_smaller_limit():
    """bob's group caps at 64: his max_tokens 3 beside max_completion_tokens 1000 stays
    3 (the other is lowered to 64), and the reservation is the larger that is left, 64;
    never 64 in both, which had an engine that reads max_tokens generate 64, not 3."""
    p, sent = _capped({"max_tokens": 3, "max_completion_tokens": 1000})
    assert (sent["max_tokens"], sent["max_completion_tokens"], p.max_tokens) == (3, 64, 64)
    p, sent = _capped({"max_completion_tokens": 5, "max_tokens": 1000})
    assert (sent["max_tokens"], sent["max_completion_tokens"], p.max_tokens) == (64, 5, 64)
    p, sent = _capped({"max_tokens": 1000})
    assert (sent["max_tokens"], p.max_tokens) == (64, 64) and "max_completion_tokens" not in sent
    p, sent = _capped({"max_completion_tokens": 1000, "max_tokens": None})
    assert (sent["max_completion_tokens"], sent["max_tokens"], p.max_tokens) == (64, None, 64)
    # no limit named: the cap, in max_tokens
    p, sent = _capped({})
    assert (sent["max_tokens"], p.max_tokens) == (64, 64) and "max_completion_tokens" not in sent
    # within the cap: untouched, bytes and all
    within = parse_chat(chat(max_tokens=3, max_completion_tokens=64))
    assert cap_max_tokens(within, 64, False) is within
    with pytest.raises(BadRequest) as e:
        _capped({"max_tokens": 3, "max_completion_tokens": 1000}, reject=True)
    assert e.value.param == "max_completion_tokens"


def test_a_group_cap_on_native_generate_lowers_max_new_tokens_only_when_above():
    def capped(params: dict):
        p = cap_max_tokens(parse_generate(orjson.dumps({"inputs": "x", "parameters": params}), False), 64, False)
        return p.max_tokens, orjson.loads(p.body)["parameters"]

    assert capped({"max_new_tokens": 1000, "do_sample": True}) == (64, {"max_new_tokens": 64, "do_sample": True})
    assert capped({}) == (64, {"max_new_tokens": 64})
    assert capped({"max_new_tokens": 3})[0] == 3
