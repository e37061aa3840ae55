"""The trainrec command line's own handling of its arguments (tools/cli.py)."""

from __future__ import annotations

import pytest
from trainrec.tools.cli import main


@pytest.mark.parametrize(
    ("argv", "usage", "unknown", "meant"),
    [
        (["inspect", "--runid", "abc", "out"], "usage: trainrec inspect", "--runid", "--run-id"),
        (["export", "csv", "out", "-o", "x", "--tpyes", "actv"], "usage: trainrec export csv", "--tpyes", "--types"),
        (["dump", "out", "--per-recrod"], "usage: trainrec dump", "--per-recrod", "--per-record"),
    ],
)
def test_a_misspelt_option_is_named_under_its_subcommands_usage_with_the_option_meant(capsys, argv, usage, unknown,
                                                                                      meant):
    """argparse gave the top-level usage and `trainrec: error: unrecognized arguments: ...`, which
    says neither which subcommand's options to look at nor which one was meant."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage), err
    cmd = usage.removeprefix("usage: ")
    assert f"{cmd}: error: unrecognized arguments: {unknown}" in err
    assert f"did you mean {meant}?" in err


def test_an_unknown_option_like_none_gets_no_guess(capsys):
    with pytest.raises(SystemExit):
        main(["inspect", "out", "--bogus"])
    err = capsys.readouterr().err
    assert "trainrec inspect: error: unrecognized arguments: --bogus" in err and "did you mean" not in err
