"""`flowengine generate`: completions of command-line and JSONL prompts on the default
model, and a one-line error (exit status 2, no traceback) for bad input."""

from __future__ import annotations

import json

import pytest

from flowengine.entrypoints.cli import main


def test_prints_completions_of_plain_and_chat_prompts(default_model_path, tmp_path, capsys) -> None:
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text(
        json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}]})
        + "\n"
    )
    rc = main(
        [
            "generate",
            "--model",
            default_model_path,
            "--max-model-len",
            "512",
            "--max-tokens",
            "12",
            "--jsonl",
            str(jsonl),
            "--json",
            "1, 2, 3, 4,",
        ]
    )
    assert rc == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [sorted(line) for line in lines] == [
        ["completion", "prompt"],
        ["completion", "messages"],
    ]
    assert "5" in lines[0]["completion"]
    assert "Paris" in lines[1]["completion"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-tokens", "0", "hi"], "max_tokens"),
        (["--temperature", "-1", "hi"], "temperature"),
        (["--max-model-len", "99999999", "hi"], "max_model_len"),
        (["--tensor-parallel-size", "2", "hi"], "tensor_parallel_size 2 does not divide"),
        (["--jsonl", "/nonexistent/prompts.jsonl"], "No such file"),
    ],
)
def test_bad_input_is_one_clear_line(default_model_path, capsys, args, message) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", default_model_path, *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.startswith("flowengine generate: error:")


def test_a_jsonl_line_that_is_not_json_is_named(tmp_path, capsys) -> None:
    # Was orjson's bare "unexpected character: line 1 column 1 (char 0)", naming
    # neither the file nor its line (each line is parsed alone, so always "line 1").
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n\nnot json\n')
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--jsonl", str(prompts)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flowengine generate: error: {prompts} line 3 is not JSON: ")
