"""The official `openai` Python client against `tessera serve`: completions and chat,
streaming and not, logprobs, usage, and errors raised as the client's exception types.

Usage: openai_client.py BASE_URL MODEL   (BASE_URL ends with /v1)
"""

import sys

import openai


def main(base_url: str, model: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    prompt = "The capital of France is"
    greedy = dict(model=model, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})

    c = client.completions.create(prompt=prompt, logprobs=2, **greedy)
    assert c.object == "text_completion", c
    choice = c.choices[0]
    assert choice.finish_reason == "length", choice
    assert c.usage.completion_tokens == 8, c.usage
    assert len(choice.logprobs.tokens) == 8
    assert "".join(choice.logprobs.tokens) == choice.text
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    assert all(tok in top for tok, top in zip(choice.logprobs.tokens, choice.logprobs.top_logprobs))

    chunks = list(client.completions.create(prompt=prompt, stream=True, stream_options={"include_usage": True}, **greedy))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == choice.text
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].choices == []

    echo = client.completions.create(prompt=prompt, echo=True, logprobs=1, model=model, max_tokens=0, temperature=0)
    assert echo.choices[0].text == prompt, echo
    assert echo.choices[0].logprobs.token_logprobs[0] is None
    assert all(lp < 0 for lp in echo.choices[0].logprobs.token_logprobs[1:])

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2, **greedy)
    assert chat.object == "chat.completion", chat
    msg = chat.choices[0].message
    assert msg.role == "assistant" and msg.content, msg
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in chat.choices[0].logprobs.content)

    parts = []
    roles = []
    for ch in client.chat.completions.create(messages=messages, stream=True, **greedy):
        assert ch.object == "chat.completion.chunk"
        delta = ch.choices[0].delta
        roles.append(delta.role)
        parts.append(delta.content or "")
    assert roles[0] == "assistant" and all(r is None for r in roles[1:]), roles
    assert "".join(parts) == msg.content, (parts, msg.content)

    models = client.models.list()
    assert [m.id for m in models.data] == [model]

    try:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
        raise AssertionError("expected NotFoundError")
    except openai.NotFoundError as e:
        assert e.status_code == 404 and "does not exist" in e.message, e
    try:
        client.completions.create(model=model, prompt="x", max_tokens=1, temperature=-1)
        raise AssertionError("expected BadRequestError")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and e.body["param"] == "temperature", e.body
    print("openai client: all checks passed")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
