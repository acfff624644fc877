"""The Slurm test's setup logic, without Slurm: the environment it installs with and its one-line failures.

The integration test (tests/integration/test_slurm.py) needs root and minutes; these run fake tools.
"""

import os
import time

from tests import conftest
from tests.integration import test_slurm as slurm

OFFLINE_PROXY = "http://127.0.0.1:9"


def test_conftest_keeps_the_proxy_settings_it_replaced():
    assert os.environ["HTTPS_PROXY"] == OFFLINE_PROXY  # what every test and its subprocesses see
    assert OFFLINE_PROXY not in conftest.ORIGINAL_PROXY_ENV.values()  # recorded before it was set
    assert set(conftest.ORIGINAL_PROXY_ENV) == {"HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy",
                                                "NO_PROXY", "no_proxy"}


def test_online_env_restores_the_users_proxies_and_drops_the_offline_ones(monkeypatch):
    monkeypatch.setattr(conftest, "ORIGINAL_PROXY_ENV", {
        "HTTP_PROXY": "http://proxy.corp:3128", "HTTPS_PROXY": None, "http_proxy": None, "https_proxy": None,
        "NO_PROXY": "localhost", "no_proxy": None})
    env = conftest.online_env()
    assert env["HTTP_PROXY"] == "http://proxy.corp:3128" and env["NO_PROXY"] == "localhost"
    assert not {"HTTPS_PROXY", "http_proxy", "https_proxy", "no_proxy"} & set(env)
    assert env["PATH"] == os.environ["PATH"]  # everything else as it is
    assert os.environ["HTTP_PROXY"] == OFFLINE_PROXY  # the tests' own environment is untouched


def fake_tool(tmp_path, body: str):
    tool = tmp_path / "local-slurm"
    tool.write_text(f"#!/usr/bin/env bash\n{body}\n")
    return tool


def test_bring_up_runs_the_tool_with_the_users_proxies(tmp_path, monkeypatch):
    monkeypatch.setattr(conftest, "ORIGINAL_PROXY_ENV", dict.fromkeys(conftest.ORIGINAL_PROXY_ENV))
    seen = tmp_path / "seen"
    tool = fake_tool(tmp_path, f'echo "$1 $2 ${{HTTPS_PROXY-unset}} ${{http_proxy-unset}}" > {seen}; echo sinfo table')
    assert slurm.bring_up(tool, nodes=2) is None
    assert seen.read_text() == "up 2 unset unset\n"


def test_bring_up_does_not_wait_for_the_daemons_it_started(tmp_path):
    # A daemon that keeps the tool's stdout/stderr open must not hold the fixture until it exits.
    tool = fake_tool(tmp_path, "sleep 3 &\necho started")
    start = time.monotonic()
    assert slurm.bring_up(tool) is None
    assert time.monotonic() - start < 2


def test_bring_up_failures_are_one_line(tmp_path):
    tool = fake_tool(tmp_path, 'echo "local-slurm: installing slurm-wlm and munge" >&2\n'
                               'echo "E: Unable to locate package slurm-wlm" >&2\nexit 100')
    assert slurm.bring_up(tool) == "`local-slurm up 2` failed (exit 100): E: Unable to locate package slurm-wlm"
    assert slurm.bring_up(fake_tool(tmp_path, "exit 1")) == "`local-slurm up 2` failed (exit 1): no output"
    assert slurm.bring_up(fake_tool(tmp_path, "sleep 5"), timeout=0.2) == (
        "`local-slurm up 2` did not finish within 0.2 s")
    missing = tmp_path / "nowhere" / "local-slurm"
    assert slurm.bring_up(missing) == f"{missing} is missing; it installs and starts the local Slurm cluster"


def test_nodes_not_ready_names_the_node_states(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    sinfo = tmp_path / "sinfo"
    sinfo.write_text("#!/bin/sh\necho idle\necho idle\n")
    sinfo.chmod(0o755)
    assert slurm.nodes_not_ready() is None
    sinfo.write_text("#!/bin/sh\necho 'down*'\necho idle\n")
    assert slurm.nodes_not_ready() == ("the Slurm nodes are down*, idle after `local-slurm up`, not idle "
                                       "(daemon logs in /var/tmp/local-slurm)")
    sinfo.unlink()
    monkeypatch.setenv("PATH", str(tmp_path))
    assert slurm.nodes_not_ready().startswith("sinfo failed after `local-slurm up`: ")
