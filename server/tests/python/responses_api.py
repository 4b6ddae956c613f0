"""The Responses API (`/v1/responses`) with the official `openai` Python client against
`tessera serve`: text answers whole and streamed (the same text at temperature 0, every event
numbered in order, the stream helper's final response), `max_output_tokens` ending
`incomplete`, the chat endpoint's answer to the same conversation, a required function call
and its two-turn round trip (streamed and not), `responses.parse` with a Pydantic model
validated by `jsonschema`, logprobs, and refusals naming the field.

Usage: responses_api.py BASE_URL MODEL   (BASE_URL ends with /v1)
"""

import json
import sys

import jsonschema
import openai
import pydantic

import tool_calls

# The chat test's tool, in the Responses API's flat form.
TOOLS = [{"type": "function", **tool_calls.TOOLS[0]["function"], "strict": True}]


class City(pydantic.BaseModel):
    name: str
    population: int = pydantic.Field(ge=0, le=100_000_000)
    coastal: bool


def streamed(client, **ask):
    """(event types, concatenated text deltas, the final response) of a streamed request."""
    types, text, final, seqs = [], "", None, []
    for e in client.responses.create(stream=True, **ask):
        types.append(e.type)
        seqs.append(e.sequence_number)
        if e.type == "response.output_text.delta":
            text += e.delta
        if e.type in ("response.completed", "response.incomplete"):
            final = e.response
    assert seqs == list(range(len(seqs))), seqs
    assert types[:2] == ["response.created", "response.in_progress"], types
    return types, text, final


def main(base_url: str, model: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    ask = dict(model=model, input="Name three colors.", instructions="Answer in one sentence.", max_output_tokens=300, temperature=0)

    whole = client.responses.create(**ask)
    assert whole.object == "response" and whole.status == "completed", whole
    assert whole.id.startswith("resp_") and whole.output_text.strip(), whole
    (msg,) = whole.output
    assert msg.type == "message" and msg.role == "assistant" and msg.status == "completed", msg
    assert whole.usage.output_tokens > 0 and whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens, whole.usage
    assert whole.instructions == ask["instructions"] and whole.max_output_tokens == 300 and whole.store is False, whole

    # The same conversation on the chat endpoint: the same tokens, the same text.
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": ask["instructions"]}, {"role": "user", "content": ask["input"]}], max_tokens=300, temperature=0
    )
    assert chat.choices[0].message.content == whole.output_text, (chat, whole)
    assert chat.usage.prompt_tokens == whole.usage.input_tokens, (chat.usage, whole.usage)

    types, text, final = streamed(client, **ask)
    assert text == whole.output_text == final.output_text, (text, whole.output_text)
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"], types
    assert final.usage.output_tokens == whole.usage.output_tokens

    with client.responses.stream(**ask) as stream:
        for _ in stream:
            pass
        assert stream.get_final_response().output_text == whole.output_text

    # Cut short: incomplete, with the reason.
    short = client.responses.create(**{**ask, "max_output_tokens": 3})
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens", short
    assert short.usage.output_tokens == 3 and short.output[0].status == "incomplete", short
    types, text, final = streamed(client, **{**ask, "max_output_tokens": 3})
    assert types[-1] == "response.incomplete" and text == short.output_text, (types, text)

    # A required call, its result, the answer; streamed, the call is one item.
    call_ask = dict(model=model, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_output_tokens=80, temperature=0)
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.responses.create(input=question, **call_ask)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id, call
    args = json.loads(call.arguments)
    jsonschema.validate(args, TOOLS[0]["parameters"])
    types, text, final = streamed(client, input=question, **call_ask)
    assert text == "" and "response.function_call_arguments.done" in types, types
    assert types.count("response.function_call_arguments.delta") > 1, "the arguments stream as written"
    (again,) = final.output
    assert (again.name, json.loads(again.arguments)) == (call.name, args), (again, call)
    named = client.responses.create(input=question, **{**call_ask, "tool_choice": {"type": "function", "name": "get_weather"}})
    assert [o.type for o in named.output] == ["function_call"], named
    turn = question + [
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"sky": "clear", "celsius": 21})},
    ]
    answer = client.responses.create(input=turn, model=model, tools=TOOLS, max_output_tokens=40, temperature=0)
    assert answer.output_text.strip() and answer.output[0].type == "message", answer

    # Structured output through text.format.
    parsed = client.responses.parse(model=model, input="Describe a city as JSON.", text_format=City, max_output_tokens=120, temperature=1, top_p=0.9)
    assert isinstance(parsed.output_parsed, City), parsed
    jsonschema.validate(json.loads(parsed.output_text), City.model_json_schema())

    # Logprobs, as the text's tokens.
    lp = client.responses.create(**{**ask, "max_output_tokens": 5}, top_logprobs=2, include=["message.output_text.logprobs"])
    tokens = lp.output[0].content[0].logprobs
    assert len(tokens) == 5 and "".join(t.token for t in tokens) == lp.output_text, tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in tokens), tokens

    # Refusals name the Responses field.
    for extra, param in [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
        ({"max_tokens": 5}, "max_tokens"),
        ({"max_output_tokens": -1}, "max_output_tokens"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
        ({"include": ["file_search_call.results"]}, "include[0]"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "wat"}}}}}}, "text.format"),
    ]:
        # Fields the client's signature lacks go through extra_body, as users send them.
        known = {k: v for k, v in extra.items() if k not in ("max_tokens",)}
        try:
            client.responses.create(**{**ask, **known}, extra_body={k: v for k, v in extra.items() if k not in known})
        except openai.BadRequestError as e:
            assert e.body["param"] == param, (extra, e.body)
        else:
            raise AssertionError(f"{extra} was accepted")
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
