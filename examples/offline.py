"""Offline batch generation with the default model (SmolLM2-135M-Instruct).

    python examples/offline.py
"""

from flowengine import LLM, SamplingParams


def main() -> None:
    llm = LLM(max_model_len=2048)
    greedy = SamplingParams(temperature=0, max_tokens=32)
    for out in llm.chat(
        [
            [{"role": "user", "content": "What is the capital of France?"}],
            [{"role": "user", "content": "Name three primary colors."}],
        ],
        greedy,
    ):
        print(repr(out.outputs[0].text))
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=24, n=2)
    for completion in llm.generate("Once upon a time", sampled)[0].outputs:
        print(completion.index, repr(completion.text), completion.finish_reason)


if __name__ == "__main__":
    main()
