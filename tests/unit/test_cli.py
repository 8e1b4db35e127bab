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
