"""The Gemini API ("gemini" in `REQUEST_APIS`): `routes` (/v1beta/models/...) and
`schemas` (the request bodies)."""
