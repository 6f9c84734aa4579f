"""Routing by model: the pool of each model name, aliases, the catch-all, the models list in
OpenAI's shape, and the 404 an unknown model gets (read by the real OpenAI SDK)."""

from __future__ import annotations

import openai
import orjson
import pytest
import yaml
from aiohttp import web

from proxy.config.loading import parse_config
from proxy.routing.model_routing import ModelTable, Route, model_error, parse_models_body
from tests.conftest import base_config
from tests.test_pool_config import pools_config


def table(cfg: dict) -> ModelTable:
    return ModelTable(parse_config(yaml.safe_dump(cfg)).effective_pools())


def no_catch_all() -> dict:
    cfg = pools_config()
    cfg["pools"][1]["models"] = ["big-model"]
    return cfg


def test_each_model_goes_to_its_pool_and_aliases_are_rewritten():
    t = table(pools_config())
    assert t.route("smol") == Route("small")
    assert t.route("tiny") == Route("small", "smol")
    assert t.route("anything-else") == Route("big")  # the catch-all
    assert t.route(None) == Route("big") and t.default_pool == "big"
    assert t.route("SMOL") == Route("big")  # model ids are case-sensitive, as OpenAI's


def test_without_a_catch_all_unknown_models_have_no_route():
    t = table(no_catch_all())
    assert t.route("big-model") == Route("big")
    assert t.route("gpt-5") is None and t.route(None) is None and t.route(["smol"]) is None
    assert t.default_pool is None


def test_the_single_upstream_form_routes_everything_to_its_one_pool():
    t = table(base_config("http://127.0.0.1:1"))
    assert t.single_upstream and t.route("whatever") == Route("default") and t.route(None) == Route("default")
    assert t.listed() == []


def test_the_models_list_is_openai_shaped_and_merges_the_catch_all_engines_list():
    t = table(pools_config())
    upstream = parse_models_body(orjson.dumps({"object": "list", "data": [{"id": "llama", "object": "model", "owned_by": "vllm"}, {"id": "smol"}]}))
    body = t.models_list(upstream)
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["smol", "tiny", "llama"]  # "smol" listed once
    for m in body["data"][:2]:  # ours; the engine's entries pass through as it wrote them
        openai.types.Model.model_validate(m)
    assert body["data"][2] == {"id": "llama", "object": "model", "owned_by": "vllm"}
    assert body["data"][0]["owned_by"] == "small"
    assert t.model("tiny") == {"id": "tiny", "object": "model", "created": 0, "owned_by": "small"}
    assert t.model("llama", upstream)["owned_by"] == "vllm"
    assert t.model("nope", upstream) is None


@pytest.mark.parametrize("junk", [b"", b"not json", b"[]", b'{"data": {}}', b'{"data": [1, {"id": 2}, {"no": "id"}]}'])
def test_a_junk_models_answer_lists_nothing(junk):
    assert parse_models_body(junk) == []


async def test_the_openai_sdk_reads_our_404_as_model_not_found(aiohttp_server):
    async def chat(request: web.Request) -> web.Response:
        return model_error((await request.json()).get("model"))

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    server = await aiohttp_server(app)
    client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="sk-x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        await client.chat.completions.create(model="gpt-unknown", messages=[{"role": "user", "content": "hi"}])
    assert e.value.code == "model_not_found" and e.value.param == "model" and "gpt-unknown" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=None, messages=[{"role": "user", "content": "hi"}])  # type: ignore[arg-type]
    assert e.value.param == "model"
    await client.close()


def test_a_huge_model_name_is_cut_in_the_message():
    body = orjson.loads(model_error("x" * 100_000).body)
    assert len(body["error"]["message"]) < 400
