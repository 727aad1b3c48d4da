"""Send one streamed chat request through the OpenAI client and print the text as it arrives,
then the request's SPADE statistics."""

from __future__ import annotations

import argparse
import time

from openai import OpenAI

DEFAULT_PROMPT = "Write a Python function that checks whether a string is a palindrome, with a short docstring."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    arguments = parser.parse_args()

    client = OpenAI(base_url=arguments.base_url, api_key="unused")
    print(f"> {arguments.prompt}\n")
    started = time.perf_counter()
    first_token_at = None
    usage = stats = None
    stream = client.chat.completions.create(
        model=arguments.model,
        messages=[{"role": "user", "content": arguments.prompt}],
        max_tokens=arguments.max_tokens,
        temperature=arguments.temperature,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first_token_at = first_token_at or time.perf_counter()
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage is not None:
            usage, stats = chunk.usage, chunk.model_extra.get("spade", {})
    elapsed = time.perf_counter() - started
    print("\n")
    if usage is None:
        print("(no usage chunk received)")
        return
    tokens = usage.completion_tokens
    calls = max(stats.get("verify_calls", 0), 1)
    print(f"tokens: {tokens} in {elapsed:.1f} s ({tokens / elapsed:.2f} tokens/s), first token after {((first_token_at or started) - started):.2f} s")
    print(f"verify calls: {stats.get('verify_calls')} ({tokens / calls:.2f} tokens per call), "
          f"accepted/drafted: {stats.get('accepted_tokens')}/{stats.get('drafted_tokens')}")
    print(f"time drafting: {stats.get('draft_ms', 0) / 1e3:.1f} s, verifying (round trips): {stats.get('verify_ms', 0) / 1e3:.1f} s, "
          f"of which target forward: {stats.get('verifier_forward_ms', 0) / 1e3:.1f} s")


if __name__ == "__main__":
    main()
