"""OpenAI's Responses API ("responses" in `REQUEST_APIS`): `routes` (POST /v1/responses,
GET /v1/responses/{id}), `schemas` (the request bodies) and `_output` (output items and
their streamed events)."""
