"""`flowengine generate`: print completions for prompts from the command line or JSONL.

    flowengine generate "Hello, my name is" "The capital of France is" --max-tokens 32
    flowengine generate --jsonl prompts.jsonl --chat      # {"prompt": ...} or {"messages": [...]}
"""

from __future__ import annotations

import argparse
import sys

import orjson

from flowengine.entrypoints.cli_args import add_engine_args, engine_args_from
from flowengine.model.errors import ModelDownloadError
from flowengine.sampling_params import SamplingParams


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="flowengine generate", description=__doc__.split("\n")[0])
    p.add_argument("prompts", nargs="*", help="prompts (each one request)")
    p.add_argument("--jsonl", help="file with one JSON object per line: prompt or messages")
    p.add_argument("--chat", action="store_true", help="wrap plain prompts in the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--json", action="store_true", help="print one JSON object per completion")
    add_engine_args(p, model_positional=False)
    ns = p.parse_args(argv)
    try:
        return _run(ns, p)
    except (ValueError, TypeError, OSError, KeyError, ImportError, ModelDownloadError) as exc:
        # Bad input (a prompt file, sampling or engine arguments, a model that cannot be
        # downloaded): the message says what to change; a traceback would only hide it.
        p.exit(2, f"{p.prog}: error: {exc}\n")


def _run(ns: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    items: list[dict] = [{"prompt": t} for t in ns.prompts]
    if ns.jsonl:
        with open(ns.jsonl, "rb") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    items.append(orjson.loads(line))
                except orjson.JSONDecodeError as err:
                    raise ValueError(f"{ns.jsonl} line {line_no} is not JSON: {err}") from None
    if not items:
        p.error("give prompts on the command line or --jsonl FILE")
    if not all(isinstance(it, dict) and ("prompt" in it or "messages" in it) for it in items):
        raise ValueError('every --jsonl line must be an object with "prompt" or "messages"')
    params = SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        seed=ns.sample_seed,
    )
    from flowengine.entrypoints.llm import LLM

    llm = LLM(**vars(engine_args_from(ns)))
    # One batch per kind, so all prompts share the engine's steps.
    chat_idx = [i for i, it in enumerate(items) if "messages" in it or ns.chat]
    text_idx = [i for i, it in enumerate(items) if i not in set(chat_idx)]
    convs = [
        items[i].get("messages") or [{"role": "user", "content": items[i]["prompt"]}]
        for i in chat_idx
    ]
    outputs: list = [None] * len(items)
    if convs:
        for i, out in zip(chat_idx, llm.chat(convs, params, use_tqdm=False), strict=True):
            outputs[i] = out
    if text_idx:
        texts = [items[i]["prompt"] for i in text_idx]
        for i, out in zip(text_idx, llm.generate(texts, params, use_tqdm=False), strict=True):
            outputs[i] = out
    for item, out in zip(items, outputs, strict=True):
        text = out.outputs[0].text
        if ns.json:
            sys.stdout.write(orjson.dumps({**item, "completion": text}).decode() + "\n")
        else:
            shown = item.get("prompt") or item.get("messages", [{}])[-1].get("content", "")
            sys.stdout.write(f"--- {shown!r}\n{text}\n")
    return 0
