"""The proxy's published OpenAPI 3.1 document (``GET /openapi.json``).

It describes the request shapes the proxy itself checks; other fields pass through to
the upstream untouched (``additionalProperties: true``).
"""

from __future__ import annotations

from aiohttp import web

_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
                "scope": {"enum": ["user", "group"], "description": "429 rate_limited only: whose limit tripped"},
                "limit": {"enum": ["requests_per_minute", "tokens_per_minute"], "description": "429 rate_limited only: which limit tripped"},
            },
            "required": ["message", "type"],
        }
    },
    "required": ["error"],
}
_MAX = {"type": "integer", "minimum": 1}
_CHAT = {
    "type": "object",
    "additionalProperties": True,
    "required": ["messages"],
    "properties": {
        "model": {"type": "string"},
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {"role": {"type": "string"}, "content": {"type": ["string", "array", "null"]}},
            },
        },
        "stream": {"type": "boolean"},
        "max_tokens": _MAX,
        "max_completion_tokens": _MAX,
    },
}
_COMPLETION = {
    "type": "object",
    "additionalProperties": True,
    "required": ["prompt"],
    "properties": {
        "model": {"type": "string"},
        "prompt": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "stream": {"type": "boolean"},
        "max_tokens": _MAX,
    },
}
_EMBEDDINGS = {
    "type": "object",
    "additionalProperties": True,
    "required": ["input"],
    "properties": {
        "model": {"type": "string"},
        "input": {
            "oneOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "minItems": 1, "maxItems": 2048, "items": {"type": "string", "minLength": 1}},
                {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
                {"type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}},
            ]
        },
    },
}
_RESPONSES = {
    "type": "object",
    "additionalProperties": True,
    "properties": {
        "model": {"type": "string"},
        "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        "instructions": {"type": "string"},
        "stream": {"type": "boolean"},
        "max_output_tokens": _MAX,
    },
}
_GENERATE = {
    "type": "object",
    "required": ["inputs", "parameters"],
    "properties": {
        "inputs": {"type": "string"},
        "parameters": {"type": "object", "properties": {"max_new_tokens": _MAX}, "additionalProperties": True},
    },
}


def _post(summary: str, schema: dict) -> dict:
    errors = {str(s): {"description": d, "content": {"application/json": {"schema": _ERROR}}} for s, d in (
        (400, "invalid request"), (401, "unknown API key, or none under require_api_key"), (404, "no pool serves this model (model_not_found)"), (413, "body too large"),
        (429, "rate limited, queue full or queue timeout (Retry-After)"), (502, "upstream unreachable or broken"),
        (503, "evicted, shutting down, no healthy engine for the model, or too many requests (Retry-After)"), (504, "upstream sent no headers in time"),
    )}
    return {
        "post": {
            "summary": summary,
            "security": [{"bearer": []}, {}],
            "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
            "responses": {"200": {"description": "the upstream's answer (JSON, or text/event-stream when streaming)"}, **errors},
        }
    }


def _get(summary: str) -> dict:
    return {"get": {"summary": summary, "responses": {"200": {"description": "ok"}}}}


DOCUMENT = {
    "openapi": "3.1.0",
    "info": {"title": "llm-qos proxy", "version": "0.1.0"},
    "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    "paths": {
        "/v1/chat/completions": _post("OpenAI chat completions, admitted by priority and token-fair share", _CHAT),
        "/v1/completions": _post("OpenAI text completions", _COMPLETION),
        "/v1/embeddings": _post("OpenAI embeddings, admitted at their prompt's cost", _EMBEDDINGS),
        "/v1/responses": _post("OpenAI Responses API (streaming: the engine's typed events, no [DONE])", _RESPONSES),
        "/generate": _post("LightLLM native generation", _GENERATE),
        "/generate_stream": _post("LightLLM native streaming generation", _GENERATE),
        "/v1/models": _get("the models served: the upstream's own, or every pool's"),
        "/v1/models/{model}": _get("one model of that list (404 model_not_found)"),
        "/health": _get("the proxy is alive"),
        "/ready": _get("the upstream answers (503 otherwise)"),
        "/metrics": _get("Prometheus metrics"),
    },
}


async def openapi(request: web.Request) -> web.Response:
    """``GET /openapi.json``."""
    return web.json_response(DOCUMENT)
