"""Talk to `flowengine serve` with the official `openai` SDK.

    flowengine serve &                       # http://127.0.0.1:8000, default model
    python examples/openai_client.py         # or --base-url URL --api-key KEY

Shows a chat completion, a streamed chat completion with the usage chunk, a legacy
completion with log-probabilities, and vLLM's extra sampling fields via `extra_body`.
"""

from __future__ import annotations

import argparse
import os

from openai import OpenAI


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default=os.environ.get("FLOWENGINE_API_KEY", "unused"))
    args = p.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    question = [{"role": "user", "content": "What is the capital of France?"}]

    reply = client.chat.completions.create(
        model=model, messages=question, max_completion_tokens=32, temperature=0
    )
    print("chat:", reply.choices[0].message.content)
    print("usage:", reply.usage.prompt_tokens, "prompt +", reply.usage.completion_tokens, "completion")

    print("stream: ", end="", flush=True)
    stream = client.chat.completions.create(
        model=model,
        messages=question,
        max_completion_tokens=32,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
        elif chunk.usage:
            print(f"\n(stream usage: {chunk.usage.completion_tokens} tokens)")

    completion = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=2
    )
    choice = completion.choices[0]
    print("completion:", repr(choice.text))
    for token, logprob in zip(choice.logprobs.tokens, choice.logprobs.token_logprobs, strict=True):
        print(f"  {token!r:>12} {logprob:8.3f}")

    sampled = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Name three colors."}],
        max_completion_tokens=24,
        temperature=0.8,
        seed=1234,
        n=2,
        extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    for c in sampled.choices:
        print(f"sample {c.index}:", c.message.content)


if __name__ == "__main__":
    main()
