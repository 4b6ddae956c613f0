"""Structured outputs through the official `openai` client against `tessera serve`:
`chat.completions.parse` with Pydantic models (nested objects, arrays, enums, bounded
numbers) returns parsed objects whose text validates with `jsonschema`; regex and choice
constraints hold over many temperature-1 samples; refused schemas are 400s naming the field.

Usage: structured_outputs.py BASE_URL MODEL   (BASE_URL ends with /v1)
"""

import json
import re
import sys
from enum import Enum
from typing import Annotated, List

import jsonschema
import openai
from pydantic import BaseModel, Field


class Address(BaseModel):
    city: str = Field(max_length=20)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    address: Address


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Palette(BaseModel):
    colors: List[Color] = Field(max_length=4)
    favourite: Color


class Measurement(BaseModel):
    celsius: float = Field(ge=-50, le=60)
    readings: List[Annotated[int, Field(ge=0, le=999)]] = Field(max_length=5)
    ok: bool


def schema_of(model: type[BaseModel]) -> dict:
    return openai.lib._pydantic.to_strict_json_schema(model)


def main(base_url: str, model: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)

    for cls, question in [
        (Person, "Describe a person who lives in Paris."),
        (Palette, "Pick some colors."),
        (Measurement, "Give a weather measurement."),
    ]:
        for temperature in (0, 1):
            r = client.chat.completions.parse(
                model=model,
                messages=[{"role": "user", "content": question}],
                response_format=cls,
                temperature=temperature,
                max_tokens=200,
                seed=3,
            )
            choice = r.choices[0]
            assert choice.finish_reason == "stop", (cls.__name__, choice)
            parsed = choice.message.parsed
            assert isinstance(parsed, cls), (cls.__name__, choice.message)
            jsonschema.validate(json.loads(choice.message.content), schema_of(cls))

    # Regex and choice hold over many samples at temperature 1 (n choices, both spellings).
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    r = client.completions.create(
        model=model, prompt="A code:", n=16, temperature=1, max_tokens=20, extra_body={"structured_outputs": {"regex": pattern}}
    )
    for c in r.choices:
        assert re.fullmatch(pattern, c.text), c.text
        assert c.finish_reason == "stop", c
    choices = ["Paris", "London", "New York", "Tokyo"]
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Name a city."}],
        n=16,
        temperature=1,
        max_tokens=10,
        extra_body={"guided_choice": choices},
    )
    assert all(c.message.content in choices for c in r.choices), [c.message.content for c in r.choices]

    # Streaming: the chunks add up to valid JSON.
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Describe a person."}],
        response_format={"type": "json_schema", "json_schema": {"name": "Person", "schema": schema_of(Person), "strict": True}},
        temperature=1,
        max_tokens=200,
        stream=True,
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    jsonschema.validate(json.loads(text), schema_of(Person))

    # json_object gives an object.
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Answer in JSON."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=100,
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)

    # A schema llguidance refuses is a 400 naming the field.
    try:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}},
        )
        raise AssertionError("an invalid schema was accepted")
    except openai.BadRequestError as e:
        assert e.body["param"] == "response_format.json_schema.schema", e.body


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    print("structured outputs: all checks passed")
