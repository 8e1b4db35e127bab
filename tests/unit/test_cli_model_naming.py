"""The model is named the same way in every command, as vLLM's `serve` names it: a positional
MODEL or `--model` (train-drafter: `--target` or `--model`); both with different values is one
line and exit status 2. `generate` takes `[MODEL] PROMPT`, positionals between options too."""

from __future__ import annotations

import pytest

from specdec import cli

TRAIN_ARGS = ("--kind", "eagle", "--data", "d", "--out", "o")


def parse(*argv: str):
    return cli.build_parser().parse_args(list(argv))


def refused(capsys, *argv: str) -> str:
    """The one-line error of a command line the parser refuses (exit status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        parse(*argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"specdec {argv[0]}: error: "), err
    return err


@pytest.mark.parametrize("command", ["serve", "bench"])
def test_serve_and_bench_take_the_model_as_positional_or_flag(command):
    assert parse(command).model is None
    assert parse(command, "m.gguf").model == "m.gguf"
    assert parse(command, "--model", "m.gguf").model == "m.gguf"
    assert parse(command, "m.gguf", "--model", "m.gguf").model == "m.gguf"  # the same: fine
    assert not hasattr(parse(command, "--model", "m.gguf"), "model_flag")


@pytest.mark.parametrize("command", ["serve", "bench"])
def test_two_different_models_are_one_line(capsys, command):
    err = refused(capsys, command, "a.gguf", "--model", "b.gguf")
    assert "'a.gguf'" in err and "--model 'b.gguf'" in err and "give it once" in err


def test_generate_takes_model_then_prompt_or_the_prompt_alone():
    args = parse("generate", "hi there")
    assert (args.model, args.prompt) == (None, "hi there")
    args = parse("generate", "dir", "hi there")
    assert (args.model, args.prompt) == ("dir", "hi there")
    args = parse("generate", "--model", "dir", "hi there")
    assert (args.model, args.prompt) == ("dir", "hi there")
    args = parse("generate", "hi there", "--model", "dir")
    assert (args.model, args.prompt) == ("dir", "hi there")


def test_generate_positionals_may_stand_between_options():
    """argparse alone would take MODEL for the prompt here and refuse the prompt."""
    args = parse("generate", "dir", "--max-tokens", "3", "hi", "--temperature", "0")
    assert (args.model, args.prompt, args.max_tokens, args.temperature) == ("dir", "hi", 3, 0.0)
    args = parse("generate", "--n", "2", "dir", "--seed", "1", "hi")
    assert (args.model, args.prompt, args.n, args.seed) == ("dir", "hi", 2, 1)


def test_generate_errors(capsys):
    err = refused(capsys, "generate", "dir", "hi", "--model", "other")
    assert "'dir'" in err and "--model 'other'" in err
    assert "the following arguments are required: prompt" in refused(capsys, "generate")
    assert "the following arguments are required: prompt" in refused(
        capsys, "generate", "--model", "dir"
    )
    assert cli.main(["generate", "a", "b", "c"]) == 2
    assert "unrecognized arguments: c" in capsys.readouterr().err


def test_train_drafter_takes_target_or_model(capsys):
    base = ("train-drafter", *TRAIN_ARGS)
    assert parse(*base).model is None
    assert parse(*base, "--target", "t").model == "t"
    assert parse(*base, "--model", "t").model == "t"
    assert "give it once" in refused(capsys, *base, "--target", "t", "--model", "u")


def test_help_names_the_model_both_ways(capsys):
    for command, usage in (("generate", "[model] prompt"), ("serve", "[model]"), ("bench", "")):
        with pytest.raises(SystemExit):
            parse(command, "--help")
        out = capsys.readouterr().out
        assert "--model MODEL" in out and usage in out, out
        assert "HF directory or GGUF file" in out
    with pytest.raises(SystemExit):
        parse("train-drafter", "--help")
    out = capsys.readouterr().out
    assert "--target MODEL" in out and "--model MODEL" in out


def test_a_missing_model_is_refused_whichever_way_it_is_named(capsys):
    for argv in (
        ["serve", "/no/such/model"],
        ["serve", "--model", "/no/such/model"],
        ["generate", "/no/such/model", "hi"],
        ["bench", "/no/such/model"],
        ["train-drafter", "--model", "/no/such/model", *TRAIN_ARGS],
    ):
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "no such model path: /no/such/model" in err, err
