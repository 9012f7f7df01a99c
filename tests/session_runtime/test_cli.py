"""`session-runtime serve`'s flags fail fast and clearly, before torch or SGLang
is imported: a port out of range or in use, --help with the defaults, --version."""

from __future__ import annotations

import argparse
import importlib.metadata
import socket

import pytest

from session_runtime.cli import main


def test_a_port_out_of_range_is_refused(capsys):
    for port in ("0", "99999", "-1"):
        assert main(["serve", "--port", port]) == 2
        assert f"--port must be between 1 and 65535, got {port}" in capsys.readouterr().err


def test_a_port_in_use_is_refused_before_the_model_loads(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    assert f"cannot bind 127.0.0.1:{port}: Address already in use" in capsys.readouterr().err


def test_help_shows_the_defaults_and_version_the_package(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("(default: 8000)", "(default: 127.0.0.1)", "(default: 4194304)", "(default: 16)"):
        assert shown in text, shown
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out == f"session-runtime {importlib.metadata.version('session-runtime')}\n"


def test_every_command_prints_its_help(capsys):
    """`--help` of every subcommand prints and exits 0 (a `%` in a help text
    once crashed argparse's formatting of `replay --help`)."""
    from session_runtime.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"serve", "replay"} <= set(commands)
    for name in commands:
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        assert e.value.code == 0, name
        assert "usage:" in capsys.readouterr().out


def test_a_missing_model_folder_fails_before_anything_heavy_is_imported(tmp_path):
    """In a fresh interpreter: the error comes back without torch or SGLang loaded."""
    import subprocess
    import sys

    code = ("import sys; from session_runtime.cli import main; rc = main(['serve', '--model', sys.argv[1]]); "
            "print(rc, 'torch' in sys.modules, 'sglang' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "missing")], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.split() == ["2", "False", "False"], out
    assert "is neither a preset" in out.stderr and "nor a local folder with config.json" in out.stderr
