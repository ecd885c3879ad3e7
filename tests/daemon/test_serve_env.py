"""`mleagle serve` takes its bind address from MLEAGLE_HOST / MLEAGLE_PORT (the Docker image sets them
and its HEALTHCHECK reads the same port); a flag wins over the environment, the environment over the
config file, and a port that is not a number fails as a bad flag does."""

from __future__ import annotations

import pytest

from mleagle.daemon.cli import build_parser, make_config


def test_host_and_port_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLEAGLE_HOST", raising=False)
    monkeypatch.delenv("MLEAGLE_PORT", raising=False)
    cfg = make_config(build_parser().parse_args([]))
    assert (cfg.server.host, cfg.server.port) == ("127.0.0.1", 8000)  # the bundled config's

    monkeypatch.setenv("MLEAGLE_HOST", "0.0.0.0")
    monkeypatch.setenv("MLEAGLE_PORT", "8123")
    cfg = make_config(build_parser().parse_args([]))
    assert (cfg.server.host, cfg.server.port) == ("0.0.0.0", 8123)
    cfg = make_config(build_parser().parse_args(["--host", "127.0.0.2", "--port", "9000"]))
    assert (cfg.server.host, cfg.server.port) == ("127.0.0.2", 9000)

    monkeypatch.setenv("MLEAGLE_PORT", "")  # empty is unset, as in `docker run -e MLEAGLE_PORT=`
    assert make_config(build_parser().parse_args([])).server.port == 8000


def test_bad_port_in_the_environment_is_a_usage_error(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MLEAGLE_PORT", "eighty")
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([])
    assert e.value.code == 2
    assert "--port: invalid int value: 'eighty'" in capsys.readouterr().err
