"""Unit tests of the command line: argument parsing, the audit table and its exit status.

`run_audit` is replaced by canned results here (the checks themselves are tests/stats).
"""

from __future__ import annotations

import pytest

from specdec import audit, cli
from specdec.audit import CheckResult

PASS = CheckResult("joint/a", 1.2, 6.0, True, True, "-log10 p; chi2 1, df 1, n 1")
CONTROL_REJECTED = CheckResult("joint/a/broken", 40.0, 6.0, False, False, "-log10 p; chi2 9")
FAIL = CheckResult("accept/b", 7.5, 5.3, False, True, "|z|; mean 1 vs 2")
CONTROL_PASSED = CheckResult("joint/b/broken", 0.5, 6.0, True, False, "-log10 p; chi2 0")


@pytest.fixture
def canned(monkeypatch):
    calls = []

    def install(results):
        def fake_run_audit(quick, *, seed=0, on_result=None):
            calls.append((quick, seed))
            for result in results:
                on_result(result, 0.1)
            return results

        monkeypatch.setattr(audit, "run_audit", fake_run_audit)
        return calls

    return install


def test_audit_passes_when_checks_pass_and_controls_are_rejected(canned, capsys):
    calls = canned([PASS, CONTROL_REJECTED])
    assert cli.main(["audit", "--quick", "--seed", "7"]) == 0
    assert calls == [(True, 7)]
    out, err = capsys.readouterr()
    assert "joint/a " in out and "pass" in out
    assert "rejected (as it must be)" in out
    assert "AUDIT PASSED" in out
    assert "joint/a/broken" in err  # one progress line per check


@pytest.mark.parametrize("bad", [FAIL, CONTROL_PASSED])
def test_audit_fails_on_a_failed_check_or_a_control_with_no_power(canned, capsys, bad):
    canned([PASS, CONTROL_REJECTED, bad])
    assert cli.main(["audit"]) == 1
    out, _ = capsys.readouterr()
    assert "AUDIT FAILED" in out and bad.name in out
    assert ("FAIL" if bad is FAIL else "NOT REJECTED") in out


def test_verbose_prints_the_details(canned, capsys):
    canned([PASS])
    cli.main(["audit", "-v"])
    assert "chi2 1, df 1, n 1" in capsys.readouterr().out


def test_a_subcommand_is_required(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        cli.main(["no-such-command"])


def test_help_lists_audit(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    assert "audit" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# One-line errors, checked before any model loads
# ---------------------------------------------------------------------------------------------


def run_main(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as exit_info:
        return exit_info.code


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["generate", "hi", "--temperature", "-1"], "temperature must be"),
        (["generate", "hi", "--top-p", "2"], "top_p must be"),
        (["generate", "hi", "--n", "0"], "n must be"),
        (["generate", "hi", "--presence-penalty", "3"], "presence_penalty must be"),
        (["generate", "hi", "--stop", ""], "stop must be"),
        (["generate", "hi", "--speculative-config", "{bad"], "not valid JSON"),
        (["generate", "hi", "--speculative-config", "[1]"], "expected a JSON object"),
        (["generate", "hi", "--speculative-config", '{"method": "medusa"}'], "medusa"),
        (["generate", "hi", "--speculative-config", '{"k": 1}'], "unknown speculative_config"),
        (["generate", "hi", "--tensor-parallel-size", "0"], "tensor_parallel_size must be"),
        (["generate", "hi", "--tensor-parallel-size", "4"], "cannot split 9 attention heads"),
        (["generate", "hi", "--threads", "0"], "--threads: must be >= 1"),
        (["generate", "hi", "--max-num-seqs", "x"], "invalid int value"),
        (["generate", "hi", "--dtype", "int8"], "invalid choice"),
        (["generate", "hi", "--bogus"], "unrecognized arguments: --bogus"),
        (["generate", "hi", "--model", "/no/such/model"], "no such model path"),
        (["generate"], "the following arguments are required: prompt"),
        (["generate", "hi", "--json-schema", "/no/such.json"], "--json-schema: no such file"),
        (["generate", "hi", "--regex", "a", "--grammar", "g"], "not allowed with argument"),
        (["serve", "--port", "70000"], "port must be in"),
        (["serve", "--seed", "x"], "invalid int value"),
        (["bench", "--model", "/no/such/model"], "no such model path"),
        (["bench", "--sweep", "--drafter", "x={bad"], "not valid JSON"),
        (["bench", "--sweep", "--trees", "8x4"], "NODESxDEPTHxTOPK"),
        (["bench", "--sweep", "--trees", "4x8x2"], "cannot exceed nodes"),
        (["train-drafter", "--kind", "eagle", "--data", "d", "--out", "o", "--option", "x"], "KEY"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(capsys, argv, words):
    """Each is refused before a model loads (the run would take seconds otherwise), in one
    line `specdec COMMAND: error: ...` on stderr, with exit status 2 and no traceback."""
    assert run_main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"specdec {argv[0]}: error: "), err
    assert words in lines[0], err
    assert "Traceback" not in err and out == ""


def test_no_cuda_is_one_line(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run_main(["generate", "hi", "--device", "cuda"]) == 2
    assert capsys.readouterr().err == (
        "specdec generate: error: device='cuda' was asked for but no CUDA device is available\n"
    )


def test_threads_default_is_half_the_usable_cores(monkeypatch):
    from specdec.cli import flags

    for cores, expected in ((1, 1), (2, 1), (16, 8), (64, 8)):
        monkeypatch.setattr(flags.os, "sched_getaffinity", lambda _, n=cores: set(range(n)))
        assert flags.default_threads() == expected
    for command in (["generate", "x"], ["serve"], ["bench"], ["audit"]):
        args = cli.build_parser().parse_args([*command, "--threads", "3"])
        assert args.threads == 3
    assert cli.build_parser().parse_args(["audit"]).threads == 1


def test_async_scheduling_is_a_bare_switch_pair():
    parse = cli.build_parser().parse_args
    assert parse(["generate", "x"]).async_scheduling == "auto"
    assert parse(["generate", "x", "--async-scheduling"]).async_scheduling is True
    assert parse(["generate", "x", "--no-async-scheduling"]).async_scheduling is False


@pytest.mark.parametrize("command", ["generate", "serve", "bench", "audit", "train-drafter"])
def test_every_flag_of_every_command_has_a_description(command):
    """Each option's help says what it does (more than its default), and choices are listed."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    for action in sub._actions:
        if action.dest in ("help",) or not action.option_strings:
            continue
        text = (action.help or "").split("default:")[0].strip(" ;(")
        assert len(text) >= 8, (command, action.option_strings, action.help)
        if action.choices:
            assert "one of" in action.help or all(str(c) in action.help for c in action.choices)
    helps = {a.dest: a.help for a in sub._actions}
    if command == "generate":
        assert "bfloat16" in helps["dtype"] and "greedy" in helps["temperature"]
        assert {"n", "stop", "logprobs", "ignore_eos"} <= set(helps)


def test_field_docs_read_the_attributes_section():
    from specdec.cli.flags import field_docs
    from specdec.engine.config import EngineConfig, SpeculativeConfig

    docs = field_docs(EngineConfig)
    assert docs["max_num_seqs"] == "requests per step."
    assert "tensor parallelism" in docs["tensor_parallel_size"]
    spec = field_docs(SpeculativeConfig)
    assert spec["prompt_lookup_min"] == spec["prompt_lookup_max"]


def test_serve_and_generate_default_to_the_same_drafter(monkeypatch, capsys):
    """Without --speculative-config both take `default_spec(model, device)` (the shipped head
    for the built-in model, prompt lookup otherwise); --no-spec turns it off. The model never
    loads."""
    import specdec.engine.llm as llm_module
    import specdec.engine.llm_engine as engine_module
    import specdec.server.lifecycle as lifecycle
    from specdec.cli.flags import default_spec
    from specdec.engine.config import SpeculativeConfig
    from specdec.server.engine_client import EngineClient

    seen = []

    class Stop(ValueError):
        pass

    def fake_engine(config, spec=None, **_):
        seen.append(spec)
        raise Stop("stop here")

    def fake_llm(model, speculative_config=None, **_):
        seen.append(speculative_config)
        raise Stop("stop here")

    def fake_launch(config, spec=None, *_, **__):  # serve's engine process
        seen.append(spec)
        raise Stop("stop here")

    class Socket:
        def close(self):
            pass

    monkeypatch.setattr(engine_module, "LLMEngine", fake_engine)
    monkeypatch.setattr(llm_module, "LLM", fake_llm)
    monkeypatch.setattr(EngineClient, "launch", staticmethod(fake_launch))
    monkeypatch.setattr(lifecycle, "bind_socket", lambda host, port: Socket())
    for model in ([], ["/"]):  # the built-in model; "another model" (any existing path)
        flag = ["--model", *model] if model else []
        assert run_main(["generate", "hi", *flag]) == 2
        assert run_main(["serve", *model]) == 2
        expected = SpeculativeConfig.from_dict(default_spec(model[0] if model else None, "auto"))
        assert seen[-2:] == [expected, expected]
    assert run_main(["serve", "--no-spec"]) == 2 and seen[-1] is None
    capsys.readouterr()
