"""Two "hosts" for real: two network namespaces joined by a veth pair, each with its own address, each running
the launcher with ``--nnodes 2`` and a c10d rendezvous on the first host. The storage is a local folder both see
(namespaces share the filesystem), as a shared filesystem would be on a cluster."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from harness import (
    GENERIC_JOB,
    assert_exactly_once,
    base_env,
    committed_values,
    job_spec,
    kill_tree,
    launcher_cmd,
    read_reports,
    start_process,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.netns]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


@dataclass
class Host:
    netns: str
    ifname: str
    address: str


def _ns_pids(netns: str) -> list[int]:
    proc = _ip("netns", "pids", netns, check=False)
    return [int(pid) for pid in proc.stdout.split()]


def _kill_namespace(netns: str) -> None:
    """SIGKILL to every process in ``netns``: the "node" dies at once."""
    for pid in _ns_pids(netns):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def hosts() -> Iterator[tuple[Host, Host]]:
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("network namespaces need root on Linux")
    if shutil.which("ip") is None:
        pytest.skip("the 'ip' command (iproute2) is not installed")
    tag = uuid.uuid4().hex[:6]
    subnet = f"10.{random.randint(64, 250)}.{random.randint(1, 250)}"
    pair = (Host(f"tbp-a-{tag}", f"tbpa{tag}", f"{subnet}.1"), Host(f"tbp-b-{tag}", f"tbpb{tag}", f"{subnet}.2"))
    try:
        for host in pair:
            _ip("netns", "add", host.netns)
        _ip("link", "add", pair[0].ifname, "type", "veth", "peer", "name", pair[1].ifname)
        for host in pair:
            _ip("link", "set", host.ifname, "netns", host.netns)
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.ifname)
            _ip("-n", host.netns, "link", "set", "lo", "up")
            _ip("-n", host.netns, "link", "set", host.ifname, "up")
    except (subprocess.CalledProcessError, OSError) as exc:
        _cleanup(pair)
        pytest.skip(f"cannot create network namespaces here: {getattr(exc, 'stderr', '') or exc}")
    try:
        yield pair
    finally:
        _cleanup(pair)


def _cleanup(pair: tuple[Host, Host]) -> None:
    for host in pair:
        _kill_namespace(host.netns)
        _ip("netns", "del", host.netns, check=False)  # also removes its end of the veth pair


def _start_nodes(pair: tuple[Host, Host], spec: dict, port: int) -> list[subprocess.Popen[str]]:
    procs = []
    for host in pair:
        env = base_env(GLOO_SOCKET_IFNAME=host.ifname)  # gloo would otherwise pick the hostname's address
        command = ["ip", "netns", "exec", host.netns] + launcher_cmd(
            "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-endpoint", f"{pair[0].address}:{port}", "--rdzv-id", "netns-test",
            "--local-addr", host.address,
            "python3", str(GENERIC_JOB), json.dumps(spec),
        )  # fmt: skip
        procs.append(start_process(command, env))
    return procs


def _finish(procs: list[subprocess.Popen[str]], timeout: float) -> list[tuple[int | None, str]]:
    outcomes = []
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=timeout)
            outcomes.append((proc.returncode, err))
    finally:
        for proc in procs:
            kill_tree(proc)
    return outcomes


@pytest.mark.timeout(420)
def test_two_hosts_complete_then_a_killed_node_and_a_rerun_give_every_example_exactly_once(hosts, tmp_path):
    """A job over two hosts (rank 0's host hosting the rendezvous) runs until the second host dies mid-run (every
    process in its namespace gets SIGKILL): the first one stops. The same command on both hosts then completes the
    job, both hosts working: every example exactly once."""
    port = random.randint(20000, 30000)
    # 1. The second host dies mid-run: the first one stops.
    storage = tmp_path / "storage"
    spec = job_spec(tmp_path, n=300, batch_size=2, checkpoint_interval=3, sleep=0.05, attempt=1)
    procs = _start_nodes(hosts, spec, port)
    try:
        # Outputs are published once the record covering them is durable (pipelined commits): wait for some.
        wait_for(
            lambda: committed_values(storage) or any(p.poll() is not None for p in procs), 150, "the first outputs"
        )
        assert all(p.poll() is None for p in procs), "a node ended before the other was killed"
        _kill_namespace(hosts[1].netns)
    finally:
        outcomes = _finish(procs, timeout=90)
    assert outcomes[0][0] != 0, "the surviving node reported success"
    assert outcomes[1][0] == -signal.SIGKILL
    partial = committed_values(storage)
    assert partial and max(partial.values()) == 1 and len(partial) < 300

    # 2. The same command on both hosts resumes and completes over the two hosts: every example exactly once.
    spec = dict(spec, attempt=2, sleep=0)
    outcomes = _finish(_start_nodes(hosts, spec, port + 1), timeout=150)
    assert [rc for rc, _ in outcomes] == [0, 0], "\n".join(err[-3000:] for _, err in outcomes)
    assert "this node hosts the c10d rendezvous" in outcomes[0][1]
    reports = read_reports(spec, 2)
    assert sorted(reports) == [0, 1] and all(r["result"]["world_size"] == 2 for r in reports.values())
    assert all(r["calls"] for r in reports.values())  # both hosts worked
    result = reports[0]["result"]
    # What was published before the crash is committed; committed stages published later (a record is
    # durable before its outputs are published) are published by the resume, before any new work.
    assert result["finished"] and result["batches_skipped"] >= len(partial) // 2 > 0
    assert_exactly_once(committed_values(storage), 300)
