"""The JSON body of an engine request, shared by the server's routes and the weight-update routes."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from sao_megatron.rollout.engine.requests import BadRequest


async def json_body(request: Request) -> dict[str, Any]:
    """The JSON object body ({} when empty); BadRequest otherwise."""
    if not await request.body():
        return {}
    try:
        body = await request.json()
    except ValueError:
        raise BadRequest("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body
