"""Every argument of `generate` that can be checked without the model is refused before the
model loads (which takes seconds), in one line a person reads once: structured-output
constraints (llguidance compiles them without a tokenizer), sampling values, the speculation's
drafter and the quantization. The loader is replaced by one that records being called: a
refused command never reaches it, and a good one does (the positive control)."""

from __future__ import annotations

import json

import pytest

from specdec import cli
from specdec.sampling import StructuredOutputsParams
from specdec.sampling.grammar import constraint_error, readable_error


class Loaded(ValueError):
    """Raised by the fake LLM (a user error, so reported in one line): the command got as far
    as loading the model."""


@pytest.fixture
def loads(monkeypatch):
    """The models the command tried to load (the fake raises `Loaded`, reported as an error)."""
    import specdec.engine.llm as llm_module

    calls = []

    def fake_llm(model, speculative_config=None, **_):
        calls.append(model)
        raise Loaded("the model would load now")

    monkeypatch.setattr(llm_module, "LLM", fake_llm)
    return calls


@pytest.fixture
def model_dir(tmp_path):
    """An existing HF-style directory (nothing in it is read before loading)."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


def generate(capsys, loads, *argv: str) -> str:
    """Runs `specdec generate ...`, which must be refused before loading; its one line."""
    try:
        status = cli.main(["generate", *argv])
    except SystemExit as exit_info:
        status = exit_info.code
    out, err = capsys.readouterr()
    assert loads == [], f"the model was loaded before refusing: {err}"
    assert status == 2 and out == "", err
    assert "loading" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("specdec generate: error: "), err
    return lines[0].removeprefix("specdec generate: error: ")


def test_a_good_command_reaches_the_loader(capsys, loads, model_dir, tmp_path):
    """The positive control: with valid flags, the same harness sees the model load."""
    grammar = tmp_path / "ok.lark"
    grammar.write_text('start: "yes" | "no"\n')
    for flags in (["--regex", "[0-9]+"], ["--grammar", str(grammar)], ["--temperature", "0"]):
        assert cli.main(["generate", str(model_dir), "hi", *flags]) == 2
        err = capsys.readouterr().err
        assert "loading" in err and "the model would load now" in err, err
    assert loads == [str(model_dir)] * 3


def test_a_bad_regex_is_one_readable_line(capsys, loads, model_dir):
    message = generate(capsys, loads, str(model_dir), "hi", "--regex", "[0-9")
    assert message == "invalid --regex '[0-9': unclosed character class"
    message = generate(capsys, loads, str(model_dir), "hi", "--regex", "(?<=a)b")
    assert message.startswith("invalid --regex '(?<=a)b': look-around")
    assert "regex parse error" not in message
    message = generate(capsys, loads, "hi", "--regex", "")
    assert message == "--regex '' is empty: it allows no output"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("start: foo\n", 'unknown name: "foo" (line 1, column 8)'),
        ("start: /[0-9/\n", 'invalid regex "[0-9": unclosed character class (line 1, column 8)'),
        ('root ::= "a" | b\n', "Rule 'b' not found"),
        ("", "is empty"),
        ("  \n", "is empty"),
    ],
)
def test_a_bad_grammar_file_is_refused(capsys, loads, model_dir, tmp_path, text, expected):
    path = tmp_path / "g.lark"
    path.write_text(text)
    message = generate(capsys, loads, str(model_dir), "hi", "--grammar", str(path))
    assert message.startswith(f"invalid --grammar {path}: ") or message.startswith(
        f"--grammar {path} "
    ), message
    assert expected in message


def test_grammar_files_that_cannot_be_read(capsys, loads, tmp_path):
    assert generate(capsys, loads, "hi", "--grammar", str(tmp_path)) == (
        f"--grammar {tmp_path} is not a file"
    )
    binary = tmp_path / "g.bin"
    binary.write_bytes(b"\xff\xfe\x00start")
    assert generate(capsys, loads, "hi", "--grammar", str(binary)).endswith("is not UTF-8 text")
    missing = tmp_path / "none.lark"
    assert generate(capsys, loads, "hi", "--grammar", str(missing)) == (
        f"--grammar: no such file: {missing}"
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"type": ', "is not valid JSON (Expecting value at line 1, column 10)"),
        ("[1, 2]", "holds a JSON list, not a JSON schema"),
        ('{"type": "foo"}', ": Invalid type: foo"),
        ('{"type": "string", "minLength": "x"}', "minLength"),
        ('{"$ref": "#/defs/x"}', "does not exist"),
    ],
)
def test_a_bad_json_schema_is_refused(capsys, loads, model_dir, tmp_path, text, expected):
    path = tmp_path / "s.json"
    path.write_text(text)
    message = generate(capsys, loads, str(model_dir), "hi", "--json-schema", str(path))
    assert str(path) in message and expected in message, message


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--temperature", "-1"], "temperature must be"),
        (["--top-p", "0"], "top_p must be in (0, 1]"),
        (["--top-k", "-5"], "top_k must be"),
        (["--n", "0"], "n must be"),
        (["--max-tokens", "0"], "max_tokens must be"),
        (["--compare", "--no-spec"], "--compare runs speculation against plain decoding"),
        (['--speculative-config={"num_speculative_tokens": 0}'], "num_speculative_tokens"),
        (['--speculative-config={"method": "eagle"}'], 'method "eagle" needs "model"'),
        (
            ['--speculative-config={"method": "draft_model", "model": "/no/such"}'],
            "speculative_config.model: no such model path: /no/such",
        ),
        (
            ['--speculative-config={"method": "draft_model", "model": "truncated:x"}'],
            'expected "truncated:<number of layers>"',
        ),
        (["--quantization", "gguf"], "is not a GGUF file"),
    ],
)
def test_sampling_speculation_and_quantization_are_checked_first(
    capsys, loads, model_dir, flags, expected
):
    assert expected in generate(capsys, loads, str(model_dir), "hi", *flags)


def test_a_hub_id_is_told_that_nothing_is_downloaded(capsys, loads):
    message = generate(capsys, loads, "HuggingFaceTB/SmolLM2-135M-Instruct", "hi")
    assert message.startswith("no such model path: HuggingFaceTB/SmolLM2-135M-Instruct")
    assert "models are not downloaded here" in message
    spec = '{"method": "draft_model", "model": "owner/draft"}'
    message = generate(capsys, loads, "hi", "--speculative-config", spec)
    assert "speculative_config.model: no such model path: owner/draft" in message
    assert "models are not downloaded here" in message


def test_constraint_error_needs_no_tokenizer():
    assert constraint_error(StructuredOutputsParams(regex="[0-9]+")) is None
    assert constraint_error(StructuredOutputsParams(grammar='start: "a"+')) is None
    assert constraint_error(StructuredOutputsParams(json={"type": "object"})) is None
    assert constraint_error(StructuredOutputsParams(choice=["yes", "no"])) is None
    assert constraint_error(StructuredOutputsParams(regex="a)")) == "unopened group"
    assert constraint_error(StructuredOutputsParams(json=json.dumps({"type": "foo"}))) == (
        "Invalid type: foo"
    )


def test_readable_error_is_one_line():
    raw = (
        'at 1(8): invalid regex "[0-9" (in regex): regex parse error:\n    [0-9\n    ^\n'
        "error: unclosed character class\n   1 | start: /[0-9/\n              ^\n"
    )
    assert readable_error(raw, "regex") == "unclosed character class"
    assert readable_error('at 3(2): unknown name: "x"\n   3 | a\n', "grammar") == (
        'unknown name: "x" (line 3, column 2)'
    )
    assert readable_error("Invalid type: foo", "json") == "Invalid type: foo"
    assert readable_error("", "json") == "rejected by the grammar compiler"
