"""OpenAI-shaped errors over real HTTP, and how the openai client reads them."""

import httpx
import openai
import pytest
from fastapi import FastAPI
from pydantic import BaseModel

from ac2_jax.serving.core.errors import APIError, install_error_handlers
from ac2_jax.serving.server import serve_in_thread


class Body(BaseModel):
    x: int


@pytest.fixture(scope="module")
def url():
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def fail(status: int = 400):
        raise APIError(status, f"failed with {status}", param="messages", code="some_code")

    @app.post("/typed")
    async def typed(body: Body):
        return {"x": body.x}

    @app.get("/crash")
    async def crash():
        raise RuntimeError("boom")

    base, stop = serve_in_thread(app)
    yield base
    stop()


def test_error_body_shape(url):
    r = httpx.post(url + "/v1/chat/completions?status=409")
    assert r.status_code == 409
    assert r.json() == {"error": {"message": "failed with 409", "type": "conflict_error",
                                  "param": "messages", "code": "some_code"}}
    r = httpx.post(url + "/v1/chat/completions?status=401")
    assert r.json()["error"]["type"] == "authentication_error"
    assert r.headers["www-authenticate"] == "Bearer"


def test_routing_validation_and_crashes_are_openai_shaped(url, caplog):
    r = httpx.get(url + "/nowhere")
    assert r.status_code == 404 and "Unknown route: GET /nowhere" in r.json()["error"]["message"]
    r = httpx.get(url + "/typed")
    assert r.status_code == 405 and "not allowed" in r.json()["error"]["message"]
    r = httpx.post(url + "/typed", json={"x": "nope"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x"
    r = httpx.get(url + "/crash")
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert "boom" not in r.text and "RuntimeError" not in r.text  # the cause stays server-side
    assert any("boom" in str(rec.exc_info) for rec in caplog.records if rec.exc_info)


@pytest.mark.parametrize("status, exc", [
    (400, openai.BadRequestError), (401, openai.AuthenticationError),
    (403, openai.PermissionDeniedError), (404, openai.NotFoundError),
    (409, openai.ConflictError), (503, openai.InternalServerError)])
def test_openai_client_raises_the_matching_class(url, status, exc):
    client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0,
                           default_query={"status": status})
    with pytest.raises(exc, match=f"failed with {status}") as e:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "some_code" and e.value.param == "messages"
