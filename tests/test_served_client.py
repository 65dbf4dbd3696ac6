"""The command-line client against the real server, and its exit codes."""
import subprocess
import sys

import pytest

from a3b_backend.profiles import PROJECT_ROOT

pytestmark = pytest.mark.served
CLIENT = [sys.executable, str(PROJECT_ROOT / "client" / "a3b_chat.py")]


def run(*args):
    return subprocess.run([*CLIENT, *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_client_streams_the_answer(server, protocol):
    url = server.grpc_url if protocol == "grpc" else server.http_url
    done = run("--protocol", protocol, "--url", url, "--temperature", "0", "--max-tokens", "32",
               "What is the capital of France?")
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout


def test_client_reports_refused_request(server):
    done = run("--url", server.grpc_url, "--max-tokens", "-1", "hi")
    assert done.returncode == 2
    assert "'max_tokens' = -1" in done.stderr


def test_client_reports_unreachable_server():
    done = run("--url", "127.0.0.1:9", "hi")
    assert done.returncode == 3
    assert "cannot reach the server" in done.stderr
