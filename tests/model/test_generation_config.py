"""--generation-config auto|vllm|DIR: which keys of generation_config.json become the
sampling defaults (vLLM's get_diff_sampling_param), and the errors."""

from __future__ import annotations

import json

import pytest

from flowengine.model.generation_config import load_generation_defaults


def _write(folder, config) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(config))
    return str(folder)


FULL = {
    "bos_token_id": 1, "eos_token_id": [2, 7], "do_sample": True,
    "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
    "repetition_penalty": 1.1, "max_new_tokens": 256, "max_length": 4096,
}  # fmt: skip


def test_auto_reads_the_model_folder(tmp_path) -> None:
    model = _write(tmp_path / "model", FULL)
    assert load_generation_defaults(model) == {
        "repetition_penalty": 1.1, "temperature": 0.6, "top_k": 20, "top_p": 0.9,
        "min_p": 0.05, "max_tokens": 256,
    }  # fmt: skip


def test_only_set_keys_and_null_ignored(tmp_path) -> None:
    model = _write(tmp_path / "model", {"eos_token_id": 2, "temperature": None, "top_p": 0.8})
    assert load_generation_defaults(model) == {"top_p": 0.8}
    assert load_generation_defaults(_write(tmp_path / "bare", {"eos_token_id": 2})) == {}
    (tmp_path / "empty").mkdir()
    assert load_generation_defaults(str(tmp_path / "empty")) == {}  # no file: no defaults
    assert load_generation_defaults(str(tmp_path / "m.gguf")) == {}


def test_vllm_ignores_the_file_and_dir_reads_another(tmp_path) -> None:
    model = _write(tmp_path / "model", FULL)
    other = _write(tmp_path / "other", {"temperature": 0.3, "max_new_tokens": 5})
    assert load_generation_defaults(model, "vllm") == {}
    assert load_generation_defaults(model, other) == {"temperature": 0.3, "max_tokens": 5}


def test_override_applies_over_the_file(tmp_path) -> None:
    model = _write(tmp_path / "model", {"temperature": 0.6, "top_p": 0.9})
    got = load_generation_defaults(model, override={"temperature": 0.2, "top_k": 4})
    assert got == {"temperature": 0.2, "top_k": 4, "top_p": 0.9}
    assert load_generation_defaults(model, "vllm", {"min_p": 0.1}) == {"min_p": 0.1}


def test_errors_name_what_to_change(tmp_path) -> None:
    model = _write(tmp_path / "model", FULL)
    with pytest.raises(ValueError, match="no generation_config.json there"):
        load_generation_defaults(model, str(tmp_path / "missing"))
    bad = _write(tmp_path / "bad", {"temperature": -1.0})
    with pytest.raises(ValueError, match="temperature"):
        load_generation_defaults(bad)
    (tmp_path / "list").mkdir()
    (tmp_path / "list" / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_generation_defaults(str(tmp_path / "list"))
