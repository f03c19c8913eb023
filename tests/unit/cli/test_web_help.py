"""``switchboard web --help`` (issue 43): it offers the console on loopback
behind a TLS proxy, never bare on every interface, and says that an address
off loopback needs the token."""

from __future__ import annotations

import ipaddress
import shlex

import pytest

from ingest.cli import help_pages
from ingest.cli.main import _parser
from ingest.config.webhook import split_listen


def test_the_console_help_suggests_loopback_behind_a_proxy_and_the_token_off_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["web", "--help"])
    page = " ".join(capsys.readouterr().out.split())
    assert "0.0.0.0" not in page
    assert "TLS-terminating proxy" in page
    assert "off loopback needs SWITCHBOARD_WEB_TOKEN" in page
    listen = _parser().parse_args(shlex.split(help_pages.EXAMPLES["web"])[1:]).listen
    assert ipaddress.ip_address(split_listen(listen)[0]).is_loopback
