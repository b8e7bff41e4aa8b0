"""The tests and harnesses reach the network only through pip, apt or npm.

At run time tests/network_guard.py refuses any connection from the test process
to an address other than loopback (and fails the test that tried); here it is
shown to refuse and to let loopback through, and the files that run outside
pytest (scripts, CI, the Makefile, benchmarks) are read for downloads of their own.
"""

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import network_guard

REPO = Path(__file__).resolve().parent.parent


def test_a_connection_to_another_host_is_refused_before_any_packet_leaves():
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): never routed, so nothing could answer anyway.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        with pytest.raises(network_guard.NonLoopbackConnection, match="192.0.2.1"):
            sock.connect(("192.0.2.1", 9))
        with pytest.raises(network_guard.NonLoopbackConnection):
            sock.connect_ex(("192.0.2.1", 9))
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
        with pytest.raises(network_guard.NonLoopbackConnection):
            sock.connect(("2001:db8::1", 9, 0, 0))
    # Recorded, so the test that made it fails even where the error was swallowed.
    taken = network_guard.take_violations()
    assert len(taken) == 3 and "192.0.2.1" in taken[0]


def test_a_swallowed_refusal_still_fails_the_test(tmp_path):
    # A harness that hides the error (as kvwatch's own fetch turns errors into
    # "engine down") still fails: the guard records the attempt. Run as its own
    # pytest session with this suite's conftest.
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        + (Path(__file__).parent / "conftest.py").read_text())
    (tmp_path / "test_reaches_out.py").write_text(
        "import urllib.request\n"
        "def test_reaches_out():\n"
        "    try:\n"
        "        urllib.request.urlopen('http://192.0.2.1:9/simple/', timeout=1)\n"
        "    except Exception:\n"
        "        pass\n")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "-o", "addopts=", str(tmp_path)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "a test left loopback" in result.stdout and "192.0.2.1" in result.stdout, result.stdout


def test_loopback_and_names_for_it_are_let_through():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        with socket.create_connection(("127.0.0.1", server.getsockname()[1]), timeout=2):
            pass
    for address in [("127.0.0.1", 1), ("127.3.4.5", 1), ("::1", 1, 0, 0), ("0.0.0.0", 1),
                    ("localhost", 1)]:
        assert network_guard.is_local(address), address
    for address in [("10.0.0.5", 1), ("8.8.8.8", 53), ("pypi.org", 443), ("2001:db8::1", 1, 0, 0)]:
        assert not network_guard.is_local(address), address


# What runs outside pytest: a download there must go through pip, apt or npm too.
REGISTRY_HOSTS = re.compile(
    r"(pypi\.org|pythonhosted\.org|github\.com|githubusercontent\.com|huggingface\.co|"
    r"registry\.npmjs\.org|deb\.debian\.org|storage\.googleapis\.com)", re.I)
FETCHERS = re.compile(r"(^|[\s;|&(`])(curl|wget)\s")
URL = re.compile(r"[a-z]+://([^/:\s\"']+)")
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "[::1]"}


def _fetches_elsewhere(line: str) -> bool:
    """A curl or wget whose addresses are not all loopback (a health check of the demo is fine)."""
    if not FETCHERS.search(line):
        return False
    hosts = URL.findall(line)
    return not hosts or any(host not in LOOPBACK_HOSTS for host in hosts)


def _outside_pytest_files() -> list[Path]:
    files = [REPO / "Makefile", REPO / ".ci" / "run"]
    for folder in ("scripts", "benchmarks", "tests"):
        files += [p for p in (REPO / folder).rglob("*")
                  if p.is_file() and p.suffix in (".py", ".sh", "")
                  and "fixtures" not in p.parts and "__pycache__" not in p.parts]
    return files


def test_no_script_builds_a_registry_address_or_fetches_by_hand():
    offenders = []
    for path in _outside_pytest_files():
        text = path.read_text(errors="replace")
        if path == Path(__file__):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if REGISTRY_HOSTS.search(line) or _fetches_elsewhere(line):
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_the_scan_would_see_an_offender():
    # The patterns above match what they must (a check that cannot fail checks nothing).
    assert REGISTRY_HOSTS.search('index = "https://pypi.org/pypi"')
    assert FETCHERS.search("curl -sSL https://example.org/x.tar.gz -o x")
    assert FETCHERS.search("  wget -q http://x")
    assert not FETCHERS.search("# curling is a sport")
    assert _fetches_elsewhere("curl -sSL https://example.org/x.tar.gz -o x")
    assert _fetches_elsewhere('wget "$URL"')  # an address the scan cannot read is refused
    assert not _fetches_elsewhere('curl -fs "http://127.0.0.1:$PORT/healthz"')
