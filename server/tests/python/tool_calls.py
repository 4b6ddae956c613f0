"""Tool calls with the official `openai` Python client against `tessera serve`: a required call
whose arguments parse and match the schema, the same call accumulated from a stream as the
client's users do, and the two-turn round trip (call, `tool` result, answer).

Usage: tool_calls.py BASE_URL MODEL   (BASE_URL ends with /v1)
"""

import json
import sys

import openai

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    }
]


def main(base_url: str, model: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    ask = dict(model=model, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=80, temperature=0)

    r = client.chat.completions.create(messages=messages, **ask)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None, choice.message
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather", call
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit"), args

    # Streamed: accumulate the deltas by index, as OpenAI's own examples do.
    calls, finish = {}, None
    for chunk in client.chat.completions.create(messages=messages, stream=True, **ask):
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                acc = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                acc["id"] = tc.id or acc["id"]
                acc["name"] += tc.function.name or ""
                acc["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls", finish
    assert list(calls) == [0] and calls[0]["name"] == "get_weather", calls
    assert json.loads(calls[0]["arguments"]) == args, (calls, args)

    # The round trip: the call and its result go back, and the model answers in text.
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    ]
    answer = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=30, temperature=0)
    assert answer.choices[0].message.content, answer
    assert not answer.choices[0].message.tool_calls, answer

    # A bad tool_choice is the client's BadRequestError, naming the parameter.
    try:
        client.chat.completions.create(model=model, messages=messages[:1], tool_choice="required", max_tokens=1)
    except openai.BadRequestError as e:
        assert e.body["param"] == "tool_choice", e.body
    else:
        raise AssertionError("tool_choice required without tools was accepted")
    print("tool calls: ok")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
