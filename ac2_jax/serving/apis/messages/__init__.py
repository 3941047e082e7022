"""Anthropic's Messages API ("anthropic" in `REQUEST_APIS`): `routes` (POST /v1/messages,
/v1/messages/count_tokens), `schemas` (the request bodies), `_blocks` (content blocks)
and `_output` (answers and their streamed events)."""
