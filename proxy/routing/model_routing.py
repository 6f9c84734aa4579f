"""Routing by model: the ``model`` a request names picks its pool, and the models list.

Rules (``docs/routing.md``):

* A request goes to the pool that lists its ``model`` (exact, case-sensitive, as OpenAI
  compares model ids). An alias (``{name, upstream_model}``) is rewritten to the engines'
  name before the body goes upstream (:func:`proxy.relay.engine_body.body_for_engine`).
* A model no pool lists goes to the catch-all pool (``"*"``), if there is one; otherwise
  the answer is 404 ``model_not_found``, shaped as OpenAI's. The single-``upstream`` form
  is a catch-all pool, so it routes every request as before.
* A body without a string ``model`` goes to the catch-all pool when there is one (the
  bundled CPU engine accepts a missing ``model``), else 400 naming ``model``.
* ``GET /v1/models`` lists every model name a pool lists, in config order (``owned_by``:
  the pool), followed by what the catch-all pool's engines list themselves. With only the
  single-upstream pool, the proxy passes the upstream's answer through as before.
  ``GET /v1/models/{id}`` answers the entry of that list, or 404 ``model_not_found``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import orjson
from aiohttp import web

from ..wire.errors import error_response
from ..config.pools import CATCH_ALL, PoolSpec

MAX_LISTED = 10_000  # entries taken from one engine's models list


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request goes.

    Attributes:
        pool: the pool's name.
        upstream_model: the ``model`` to send upstream instead of the client's (an
            alias), or ``None`` to send the body's ``model`` unchanged.
    """

    pool: str
    upstream_model: str | None = None


class ModelTable:
    """The model names of a config's pools (build one per config, on load and reload).

    Args:
        pools: the resolved pools (:meth:`proxy.config.schema.Config.effective_pools`); the config
            validator has already refused a name in two pools and two catch-alls.
    """

    def __init__(self, pools: Sequence[PoolSpec]) -> None:
        self.pools = tuple(pools)
        self._routes: dict[str, Route] = {}
        self.catch_all: str | None = None
        for p in self.pools:
            for m in p.models:
                if m.name == CATCH_ALL:
                    self.catch_all = p.name
                else:
                    self._routes[m.name] = Route(p.name, m.upstream_model)

    @property
    def single_upstream(self) -> bool:
        """Whether this is the single-``upstream`` form (models list passed through)."""
        return len(self.pools) == 1 and self.pools[0].single_upstream

    @property
    def default_pool(self) -> str | None:
        """The pool of a request that names no model: the catch-all, else the only pool."""
        if self.catch_all is not None:
            return self.catch_all
        return self.pools[0].name if len(self.pools) == 1 else None

    def route(self, model: object) -> Route | None:
        """The route of a request whose body's ``model`` is ``model`` (any JSON value, or
        ``None`` when absent); ``None`` when no pool takes it (see :func:`model_error`)."""
        if isinstance(model, str):
            r = self._routes.get(model)
            if r is not None:
                return r
        if self.catch_all is not None:
            return Route(self.catch_all)
        return None

    def native_route(self, model: object) -> Route | None:
        """The pool of a LightLLM native request (never an alias: its body goes as it
        is): the pool that lists its ``model`` when it names one a pool lists, else the
        catch-all (or only) pool; ``None`` when there is neither."""
        route = self.route(model) if isinstance(model, str) else None
        if route is not None and (route.pool != self.catch_all or self.catch_all is None):
            return Route(route.pool)
        default = self.default_pool
        return Route(default) if default is not None else None

    def unnamed_route(self) -> Route | None:
        """The pool of a pass-through request whose body names no model (an upload, a
        ``GET``): :attr:`default_pool`, or ``None``."""
        return Route(self.default_pool) if self.default_pool is not None else None

    def listed(self) -> list[dict]:
        """OpenAI model objects of the names pools list (config order), catch-all aside."""
        return [model_object(name, r.pool) for name, r in self._routes.items()]

    def models_list(self, catch_all_models: Iterable[dict] = ()) -> dict:
        """The ``GET /v1/models`` body: :meth:`listed`, then ``catch_all_models`` (the
        objects the catch-all pool's engine listed, :func:`parse_models_body`) whose ids
        are not listed already."""
        data = self.listed()
        seen = {d["id"] for d in data}
        for obj in catch_all_models:
            if obj["id"] not in seen:
                seen.add(obj["id"])
                data.append(obj)
        return {"object": "list", "data": data}

    def model(self, model_id: str, catch_all_models: Iterable[dict] = ()) -> dict | None:
        """The ``GET /v1/models/{id}`` body, or ``None`` (answer :func:`model_error`)."""
        r = self._routes.get(model_id)
        if r is not None:
            return model_object(model_id, r.pool)
        return next((obj for obj in catch_all_models if obj["id"] == model_id), None)


def model_object(model_id: str, owner: str) -> dict:
    """One entry of an OpenAI models list: ``{"id", "object": "model", "created",
    "owned_by"}`` (``created`` 0: the proxy does not know when a model was made)."""
    return {"id": model_id, "object": "model", "created": 0, "owned_by": owner}


def parse_models_body(body: bytes) -> list[dict]:
    """The model objects of an upstream's ``GET /v1/models`` answer (its ``data`` entries
    that are objects with a string ``id``, at most :data:`MAX_LISTED`); ``[]`` for an
    answer that is not such a list."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return []
    data = obj.get("data") if isinstance(obj, dict) else None
    if not isinstance(data, list):
        return []
    return [d for d in data[:MAX_LISTED] if isinstance(d, dict) and isinstance(d.get("id"), str)]


def model_error(model: object) -> web.Response:
    """The answer to a request no pool takes: 400 when ``model`` is missing or not a
    string, 404 ``model_not_found`` (OpenAI's code, ``param: model``) for an unknown name."""
    if not isinstance(model, str):
        return error_response(400, "you must provide a model parameter (a string)", code="invalid_request", param="model")
    shown = model if len(model) <= 200 else model[:197] + "..."
    return error_response(404, f"the model {shown!r} does not exist or is not served here", code="model_not_found", param="model")

