"""The OpenAPI 3.1 document, generated from the msgspec schemas and the route table."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

from agentrt.server.schemas import ErrorResponse


@dataclass(frozen=True, slots=True)
class Operation:
    method: str  # "get" | "post" | "delete"
    path: str  # OpenAPI path, e.g. "/v1/programs/{program_id}"
    summary: str
    response: type | None  # JSON body of a 200, or None for a non-JSON one
    body: type | None = None  # JSON request body
    streams: type | None = None  # may answer with text/event-stream: the JSON type of each event's data
    media_type: str | None = None  # the 200's media type when not JSON
    errors: tuple[int, ...] = (400, 401, 413, 429, 500)
    auth: bool = True
    query: tuple[tuple[str, dict[str, Any]], ...] = ()  # (name, schema) of query parameters
    ok: int = 200  # status of a success
    error_body: type = ErrorResponse  # JSON body of an error (Anthropic's shape on /v1/messages)


def build(operations: list[Operation], title: str, version: str) -> dict[str, Any]:
    used = {t for op in operations for t in (op.body, op.response, op.streams, op.error_body) if t is not None}
    types = sorted(used, key=lambda t: t.__name__)
    schemas, components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    ref = dict(zip(types, schemas))
    paths: dict[str, dict[str, Any]] = {}
    for op in operations:
        if op.response is not None:
            content = {"application/json": {"schema": ref[op.response]}}
        else:
            media_type = op.media_type or "text/plain"
            content = {media_type: {"schema": {"type": "object" if media_type == "application/json" else "string"}}}
        if op.streams is not None:
            content["text/event-stream"] = {"schema": _sse_event(ref[op.streams], ref[op.error_body])}
        responses: dict[str, Any] = {str(op.ok): {"description": "OK", "content": content}}
        error = {"application/json": {"schema": ref[op.error_body]}}
        for status in op.errors:
            responses[str(status)] = {"description": _REASONS.get(status, "error"), "content": error}
        spec: dict[str, Any] = {"summary": op.summary, "operationId": _op_id(op), "responses": responses}
        params = [{"name": n, "in": "query", "required": False, "schema": s} for n, s in op.query]
        for name in re.findall(r"{(\w+)}", op.path):
            params.append({"name": name, "in": "path", "required": True, "schema": {"type": "string"}})
        if params:
            spec["parameters"] = params
        if op.body is not None:
            spec["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref[op.body]}}}
        if op.auth:
            spec["security"] = [{"bearer": []}]
        paths.setdefault(op.path, {})[op.method] = spec
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def _sse_event(chunk: dict[str, Any], error: dict[str, Any]) -> dict[str, Any]:
    """One server-sent event (OpenAPI before 3.2 has `schema` describe each event of a stream): its
    data is a JSON chunk, an error body (an error after the stream began), or `[DONE]` at the end."""
    data = {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": [chunk, error]}}
    return {"type": "object", "required": ["data"],
            "properties": {"data": {"anyOf": [{"const": "[DONE]"}, data]}, "event": {"type": "string"}}}


def _op_id(op: Operation) -> str:
    words = [w for w in op.path.replace("{", "").replace("}", "").split("/") if w and w != "v1"]
    return "_".join([op.method, *words]).replace(".", "_")


_REASONS = {
    400: "invalid request", 401: "missing or wrong API key", 404: "not found", 409: "conflict",
    413: "request body too large", 429: "too many queued calls; retry after Retry-After seconds",
    500: "server error", 503: "server shutting down",
}
