"""`session-runtime serve`'s upstream flags, from the command line to the
RuntimeConfig and ApiSettings they make; no server is started."""

from __future__ import annotations

import json

import pytest

from session_runtime.cli import api_settings_from_args, build_parser, config_from_args, main
from session_runtime.protocols.base import PASSTHROUGH_ENV

URL = "https://api.deepseek.com/v1"


def config(*flags: str):
    return config_from_args(build_parser().parse_args(["serve", *flags]))


@pytest.fixture(autouse=True)
def no_passthrough_env(monkeypatch):
    monkeypatch.delenv(PASSTHROUGH_ENV, raising=False)


def test_upstream_sets_the_upstream_backend_and_its_flags():
    c = config("--upstream", URL, "--upstream-protocol", "anthropic", "--upstream-key", "sk-1",
               "--upstream-model", "claude-x", "--upstream-timeout-s", "30", "--keep-tool-turn-reasoning")
    assert (c.backend, c.upstream_url, c.upstream_protocol, c.upstream_key, c.upstream_model) == (
        "upstream", URL, "anthropic", "sk-1", "claude-x")
    assert (c.upstream_timeout_s, c.keep_tool_turn_reasoning, c.reasoning_passthrough) == (30.0, True, False)
    assert "sk-1" not in repr(c)
    assert config("--upstream", URL, "--backend", "upstream").backend == "upstream"
    plain = config()
    assert (plain.backend, plain.upstream_url, plain.upstream_protocol) == ("embedded", None, "deepseek")


@pytest.mark.parametrize("flags, message", [
    (["--upstream", URL, "--backend", "sglang"], "--upstream answers steps with a provider's API: it does not go "
                                                 "with --backend sglang"),
    (["--upstream", URL, "--validate", "deepseek"], "--validate answers with the local engine: it does not go "
                                                    "with --upstream"),
    (["--backend", "upstream"], "--backend upstream needs --upstream URL"),
    (["--upstream", "ftp://api.example"], "upstream_url: 'ftp://api.example' is not an http:// or https:// URL "
                                          "with a host"),
    (["--upstream", "http://api.example:port/v1"], "upstream_url: 'http://api.example:port/v1': the port is not a "
                                                   "number from 0 to 65535"),
    (["--backend", "sglang", "--sglang-url", "localhost:30000"], "sglang_url: 'localhost:30000' is not an http:// "
                                                                 "or https:// URL with a host"),
])
def test_flags_that_do_not_go_together_are_refused(flags, message, capsys):
    with pytest.raises(ValueError) as e:
        config(*flags)
    assert str(e.value) == message
    assert main(["serve", *flags]) == 2  # before anything is loaded or bound
    assert capsys.readouterr().err == f"session-runtime: {message}\n"


def test_upstream_params_are_name_and_json():
    c = config("--upstream", URL, "--upstream-param", 'thinking={"type": "enabled"}',
               "--upstream-param", " reasoning_effort =\"high\"", "--upstream-param", "n=1")
    assert c.upstream_params == (("thinking", '{"type": "enabled"}'), ("reasoning_effort", '"high"'), ("n", "1"))
    assert {name: json.loads(text) for name, text in c.upstream_params} == {
        "thinking": {"type": "enabled"}, "reasoning_effort": "high", "n": 1}


@pytest.mark.parametrize("param, message", [
    ("x=notjson", "--upstream-param 'x=notjson': 'notjson' is not JSON (a string is quoted: x='\"notjson\"')"),
    ("=1", "--upstream-param '=1': expected NAME=JSON"),
    ("thinking", "--upstream-param 'thinking': expected NAME=JSON"),
    ("x=", "--upstream-param 'x=': '' is not JSON"),
])
def test_a_bad_upstream_param_is_refused(param, message, capsys):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        config("--upstream", URL, "--upstream-param", param)
    assert main(["serve", "--upstream", URL, "--upstream-param", param]) == 2
    assert capsys.readouterr().err.startswith(f"session-runtime: {message}")


def test_reasoning_passthrough_by_flag_or_environment(monkeypatch):
    assert config("--upstream", URL, "--reasoning-passthrough").reasoning_passthrough
    monkeypatch.setenv(PASSTHROUGH_ENV, "1")
    assert config("--upstream", URL).reasoning_passthrough
    monkeypatch.setenv(PASSTHROUGH_ENV, "0")
    assert not config("--upstream", URL).reasoning_passthrough


def test_validate_goes_to_the_api_settings():
    args = build_parser().parse_args(["serve", "--validate", "openai-responses"])
    assert api_settings_from_args(args).validate == "openai-responses"
    assert config_from_args(args).backend == "embedded"  # the local engine answers what passes
    assert api_settings_from_args(build_parser().parse_args(["serve"])).validate is None
    assert api_settings_from_args(build_parser().parse_args(["serve", "--validate", "gemini"])).validate == "gemini"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--validate", "bard"])
