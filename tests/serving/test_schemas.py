"""The one validation layer: pydantic models, params from the error location."""

import pytest

from ac2_jax.serving.core import schemas
from ac2_jax.serving.core.errors import APIError


def refused(model, body):
    with pytest.raises(APIError) as e:
        schemas.validate(model, body)
    assert e.value.status == 400, e.value.message
    return e.value


def test_unknown_field_is_named():
    err = refused(schemas.CompletionBody, {"model": "m", "prompt": "x", "temperatur": 1})
    assert (err.param, err.code) == ("temperatur", "unsupported_field")
    assert "temperatur" in err.message


def test_nested_param_comes_from_the_location():
    body = {"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": "robot"}]}
    assert refused(schemas.ChatCompletionBody, body).param == "messages[1].role"
    assert schemas.param_of(("messages", 0, "content")) == "messages[0].content"
    body = {"model": "m", "prompt": "x", "metadata": {"agent": "a"}}
    assert refused(schemas.CompletionBody, body).param == "metadata.agent"


class MessagesLikeBody(schemas.SamplingBody):
    """What a new API (Anthropic Messages, OpenAI Responses) would add: its own fields only."""

    system: str | None = None


@pytest.mark.parametrize("model", [schemas.ChatCompletionBody, schemas.CompletionBody,
                                   MessagesLikeBody])
@pytest.mark.parametrize("kw, param", [({"top_p": 0}, "top_p"), ({"n": "2"}, "n"),
                                       ({"stop": [""]}, "stop"), ({"store": True}, "store"),
                                       ({"no_such": 1}, "no_such")])
def test_base_fields_are_validated_by_the_base_for_every_api(model, kw, param):
    body = {"model": "m", "messages": [{"role": "user", "content": "a"}], "prompt": "x"}
    body = {k: v for k, v in body.items() if k in model.model_fields}
    assert refused(model, {**body, **kw}).param == param
    assert schemas.validate(model, body).model == "m"


def test_body_must_be_an_object():
    assert "JSON object" in refused(schemas.SamplingBody, [1]).message
