"""Structured output through `ferry serve` with the official openai client: `parse()` returns a
parsed object for a dozen Pydantic schemas at temperature 0.8, every time; regex and choice outputs
match; streamed JSON parses; a bad schema is a 400 naming its field."""

from __future__ import annotations

import asyncio
import enum
import json
import re
from typing import Annotated, Literal

import openai
import pytest
from pydantic import BaseModel, Field
from server_utils import ServerProcess


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--max-model-len", "1024", "--max-num-seqs", "32", "--served-model-name", "smol")
    yield s
    assert s.stop() == 0, s.logs()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


Name = Field(min_length=1, max_length=24)


class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Person(BaseModel):
    name: str = Name
    age: int = Field(ge=0, le=120)


class Address(BaseModel):
    street: str = Name
    city: str = Name
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Customer(BaseModel):  # nested object
    person: Person
    address: Address


class Team(BaseModel):  # array of objects
    team: str = Name
    members: list[Person] = Field(min_length=1, max_length=3)


class Paint(BaseModel):  # enum
    color: Color
    finish: Literal["matte", "gloss"]


class Reading(BaseModel):  # numbers with bounds (multipleOf bounds the decimals a sampled model may run on)
    celsius: float = Field(ge=-50, le=60, multiple_of=0.1)
    humidity: int = Field(ge=0, le=100)


class Profile(BaseModel):  # optional fields
    handle: str = Name
    bio: str | None = Field(default=None, max_length=40)
    followers: int | None = Field(default=None, ge=0, le=10**6)


class Tags(BaseModel):  # array of strings
    # Every string bounded: an unbounded one lets a sampled model write until max_tokens (seen in CI).
    tags: list[Annotated[str, Field(min_length=1, max_length=20)]] = Field(min_length=1, max_length=4)


class Flag(BaseModel):  # booleans
    enabled: bool
    beta: bool


class Item(BaseModel):
    sku: str = Field(pattern=r"^[A-Z]{3}-[0-9]{3}$")
    qty: int = Field(ge=1, le=9)


class Order(BaseModel):  # nested arrays with patterns
    order_id: int = Field(ge=1, le=99999)
    items: list[Item] = Field(min_length=1, max_length=3)


class Event(BaseModel):  # date-like string with a pattern, and a list of enums
    title: str = Name
    date: str = Field(pattern=r"^20[0-9]{2}-[01][0-9]-[0-3][0-9]$")
    colors: list[Color] = Field(max_length=3)


class Point(BaseModel):
    x: int = Field(ge=-100, le=100)
    y: int = Field(ge=-100, le=100)


class Shape(BaseModel):  # nested list of small objects with a literal tag
    kind: Literal["polygon", "line"]
    points: list[Point] = Field(min_length=2, max_length=4)


SCHEMAS = [
    (Person, "Invent a person."),
    (Customer, "Invent a customer with an address."),
    (Team, "Invent a small team."),
    (Paint, "Pick a paint."),
    (Reading, "Report the weather."),
    (Profile, "Write a social media profile."),
    (Tags, "Tag a blog post about cooking."),
    (Flag, "Set two feature flags."),
    (Order, "Write a shop order."),
    (Event, "Plan an event."),
    (Shape, "Draw a shape."),
    (Point, "Pick a point."),
]


def _maps_tokenizers(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "tokenizers.abi3" in f.read()


def test_the_engine_core_loads_its_tokenizer_for_the_first_grammar(client, server):
    """(First in this module: no structured request has reached this server before it.) The core
    starts without a tokenizer (its API process tokenizes; transformers' import was ~1 s of its start)
    and stops at the tokenizer's EOS all the same; the first structured-output request loads it."""
    core = server.core_pid()
    plain = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi!"}],
                                           max_tokens=200, temperature=0.0)  # fmt: skip
    assert plain.choices[0].finish_reason == "stop"  # the chat ends at <|im_end|>, the tokenizer's EOS
    assert not _maps_tokenizers(core)
    assert _maps_tokenizers(server.proc.pid)
    pick = client.completions.create(model="smol", prompt="Is the sky blue?", max_tokens=4, temperature=0.0,
                                     extra_body={"structured_outputs": {"choice": ["yes", "no"]}})  # fmt: skip
    assert pick.choices[0].text in ("yes", "no")
    assert _maps_tokenizers(core)


def test_parse_returns_a_valid_object_for_every_schema_at_temperature_08(server):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)

    async def one(model: type[BaseModel], prompt: str):
        return await client.chat.completions.parse(
            model="smol",
            messages=[{"role": "user", "content": prompt + " Answer in JSON."}],
            response_format=model,
            temperature=0.8,
            max_completion_tokens=300,
            n=2,
        )

    async def all_of_them():
        try:
            return await asyncio.gather(*(one(m, p) for m, p in SCHEMAS))
        finally:
            await client.close()

    results = asyncio.run(all_of_them())
    for (model, _), completion in zip(SCHEMAS, results):
        assert len(completion.choices) == 2
        for choice in completion.choices:
            assert choice.finish_reason == "stop", (model.__name__, choice.message.content)
            assert isinstance(choice.message.parsed, model), (model.__name__, choice.message.content)


def test_regex_and_choice_through_structured_outputs(client):
    pattern = r"\(\d{3}\) \d{3}-\d{4}"
    phone = client.completions.create(model="smol", prompt="Call me at", max_tokens=30, temperature=0.8, n=3,
                                      extra_body={"structured_outputs": {"regex": pattern}})  # fmt: skip
    assert all(re.fullmatch(pattern, c.text) for c in phone.choices), [c.text for c in phone.choices]
    pick = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
        temperature=0.8,
        n=3,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert all(c.message.content in ("yes", "no") and c.finish_reason == "stop" for c in pick.choices)


def test_streamed_json_object_parses(client):
    stream = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Give a cat's name and color as a JSON object, nothing else."}],
        response_format={"type": "json_object"},
        temperature=0.0,
        max_completion_tokens=300,
        stream=True,
    )
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    assert chunks[-1].finish_reason == "stop"
    assert isinstance(json.loads("".join(c.delta.content or "" for c in chunks)), dict)


def test_completions_take_response_format_too(client):
    out = client.completions.create(
        model="smol",
        prompt="A JSON object describing a dog:",
        max_tokens=120,
        temperature=0.0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "dog", "schema": {
            "type": "object", "properties": {"breed": {"type": "string", "maxLength": 20}}, "required": ["breed"],
            "additionalProperties": False}}}},
    )  # fmt: skip
    assert list(json.loads(out.choices[0].text)) == ["breed"]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
         "response_format.json_schema.schema"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a dog"}}},
         "response_format.json_schema.name"),  # OpenAI's pattern: letters, digits, _ and -
    ],
)  # fmt: skip
def test_a_bad_spec_is_a_400_naming_its_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_body=extra)  # fmt: skip
    assert e.value.body["param"] == param, e.value.body
