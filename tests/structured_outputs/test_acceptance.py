"""Acceptance of structured outputs on the default model (issue 13).

One `LLM.generate` call batches every sample: 30 JSON schemas (tests/data/
json_schemas.json, JSON Schema Store-style: nested objects, arrays with min/maxItems,
enums, anyOf, $ref, formats and patterns, bounded numbers) x 10 samples at
temperature 1.0, plus 10 samples each of a regex, a choice and an EBNF grammar. Every
output must parse and validate (jsonschema with its format checker), match the
regex, be one of the choices, or be in the grammar's language. The schemas bound
every string, so a sample ends well within max_tokens; a sample cut by max_tokens
would fail to parse and fails the test (the constraint must end the output).
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import jsonschema
import pytest

from flowengine import LLM, SamplingParams, StructuredOutputsParams
from flowengine.structured_outputs import select_backend

SCHEMAS = json.loads((Path(__file__).parents[1] / "data" / "json_schemas.json").read_text())[
    "schemas"]
# The acceptance is 10 samples per constraint (FLOWENGINE_ACCEPTANCE_SAMPLES=10,
# about 5 minutes on two idle cores); CI's default run takes 2, to keep the suite short.
NUM_SAMPLES = int(os.environ.get("FLOWENGINE_ACCEPTANCE_SAMPLES", "2"))
# Room for the longest valid document of every schema: survey_response's worst case (a
# uuid, four 20-character answers, a timestamp) is about 300 tokens, since SmolLM2's
# tokenizer spends one token per digit; 256 cut such a sample short in a CI run.
MAX_TOKENS = 512

PHONE_REGEX = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
CHOICES = ["positive", "negative", "neutral", "mixed"]
# Arithmetic over small integers, at most four operators (bounded, so it always ends).
ARITH_EBNF = r'''
root ::= expr
expr ::= term (" " op " " term){0,4}
term ::= num | "(" num " " op " " num ")"
op ::= "+" | "-" | "*"
num ::= [1-9] [0-9]?
'''
ARITH_RE = re.compile(r"^(N)( [+*-] (N)){0,4}$".replace(
    "N", r"[1-9][0-9]?|\([1-9][0-9]? [+*-] [1-9][0-9]?\)"))


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    # Every sample in one batch: 33 prompts x 10 samples.
    engine = LLM(kv_cache_memory_bytes=5 << 29, max_num_seqs=336, seed=0)
    yield engine
    engine.shutdown()


def _chat(llm: LLM, text: str) -> str:
    return llm.input_processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


def test_samples_at_temperature_1_always_satisfy_their_constraint(llm):
    seed = random.randrange(1 << 30)
    jobs: list[tuple[str, str, StructuredOutputsParams]] = []
    for name, schema in SCHEMAS.items():
        # A short prompt (prefill is most of the CPU time): the constraint does the rest.
        prompt = _chat(llm, f"Write an example {schema.get('title', name)} as JSON.")
        jobs.append((name, prompt, StructuredOutputsParams(json=schema,
                                                           disable_any_whitespace=True)))
    jobs.append(("regex", _chat(llm, "Give a US phone number."),
                 StructuredOutputsParams(regex=PHONE_REGEX)))
    jobs.append(("choice", _chat(llm, "Classify the sentiment of: 'The food was great but "
                                      "the service was slow.'"),
                 StructuredOutputsParams(choice=CHOICES)))
    jobs.append(("grammar", _chat(llm, "Write an arithmetic expression."),
                 StructuredOutputsParams(grammar=ARITH_EBNF)))
    params = [SamplingParams(n=NUM_SAMPLES, temperature=1.0, max_tokens=MAX_TOKENS,
                             seed=seed + i, structured_outputs=so)
              for i, (_, _, so) in enumerate(jobs)]
    outputs = llm.generate([p for _, p, _ in jobs], params, use_tqdm=False)

    # Both backends served: "auto" sends the schemas xgrammar cannot fully honour
    # (format with maxLength) to llguidance.
    backends = {select_backend("auto", so.kind, so.spec) for _, _, so in jobs}
    assert backends == {"xgrammar", "guidance"}
    failures = []
    for (name, _, so), out in zip(jobs, outputs, strict=True):
        assert len(out.outputs) == NUM_SAMPLES
        for sample in out.outputs:
            text, where = sample.text, f"{name} (seed {seed}): {sample.text!r}"
            if sample.finish_reason != "stop":
                failures.append(f"{where} finished with {sample.finish_reason}")
            elif name == "regex":
                if not re.fullmatch(PHONE_REGEX, text):
                    failures.append(f"{where} does not match {PHONE_REGEX}")
            elif name == "choice":
                if text not in CHOICES:
                    failures.append(f"{where} is not one of {CHOICES}")
            elif name == "grammar":
                if not ARITH_RE.fullmatch(text):
                    failures.append(f"{where} is not in the grammar's language")
            else:
                try:
                    instance = json.loads(text)
                except ValueError as exc:
                    failures.append(f"{where} does not parse: {exc}")
                    continue
                validator = jsonschema.validators.validator_for(so.json)
                errors = list(validator(so.json, format_checker=validator.FORMAT_CHECKER)
                              .iter_errors(instance))
                if errors:
                    failures.append(f"{where} is invalid: {errors[0].message}")
    assert failures == []
