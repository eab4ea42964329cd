"""Stream several requests concurrently through AsyncEngine.submit().

    python examples/async_submit.py [--multiproc]
"""

import asyncio
import sys

from flowengine import AsyncEngine, RequestOutputKind, SamplingParams


async def stream(engine: AsyncEngine, prompt: str) -> str:
    text = ""
    params = SamplingParams(temperature=0, max_tokens=32)
    async for out in engine.submit(prompt, params, output_kind=RequestOutputKind.DELTA):
        text += out.outputs[0].text  # DELTA: each output holds only the new text
    return text


async def main() -> None:
    placement = "multiproc" if "--multiproc" in sys.argv else "inproc"
    engine = AsyncEngine(placement=placement, max_model_len=2048)
    await engine.start()
    try:
        prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
        texts = await asyncio.gather(*(stream(engine, p) for p in prompts))
        for prompt, text in zip(prompts, texts, strict=True):
            print(f"{prompt!r} -> {text!r}")
    finally:
        await engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
