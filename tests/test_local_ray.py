"""The local Ray the platform starts (issue #61, item 6): loopback only, and out of the
driver's process group.

``init_ray`` with no address starts Ray on this machine; its node address and every
server its processes open must be 127.0.0.1, and a signal to the driver's process
group (``timeout``, a scheduler) must not reach Ray's own processes. A multi-node
cluster (``--address``, ``RAY_ADDRESS``) is joined, not started: its addresses are
its own (tests/test_train_ray.py's ``init_ray`` tests).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# In a process of its own: Ray's switch is read by the processes it starts, and this
# test must see what a fresh `splitvit train` gets, not the session's shared Ray.
PROBE = r"""
import json, os
import ray
import psutil  # the copy Ray ships (ray/thirdparty_files), on the path once ray is imported
from splitvit.train.ray_trainer import init_ray, LOOPBACK_ENV

init_ray()

@ray.remote
def where():
    return ray.util.get_node_ip_address(), os.getsid(0), os.getpgid(0)

task_ip, task_sid, task_pgid = ray.get(where.remote())
me = psutil.Process()
ours = me.children(recursive=True)
listening = sorted(
    {c.laddr.ip for p in ours for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
)
print(json.dumps({
    "node": [n["NodeManagerAddress"] for n in ray.nodes()],
    "gcs": ray.get_runtime_context().gcs_address,
    "task_ip": task_ip,
    "listening": listening,
    "driver_pgid": os.getpgid(0),
    "driver_sid": os.getsid(0),
    "children_pgids": sorted({os.getpgid(p.pid) for p in ours}),
    "task_sid": task_sid,
    "task_pgid": task_pgid,
    "env_after": os.environ.get(LOOPBACK_ENV),
}))
ray.shutdown()
"""


@pytest.mark.slow
def test_the_local_ray_listens_on_loopback_only_and_out_of_the_drivers_group(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(ROOT / "platform"), MLFLOW_DISABLE_TELEMETRY="true")
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    proc = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        start_new_session=True,  # its own group, as `splitvit train` from a shell
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["node"] == ["127.0.0.1"], found
    assert found["gcs"].startswith("127.0.0.1:"), found
    assert found["task_ip"] == "127.0.0.1", found
    # every server Ray's processes opened: loopback (IPv4, or IPv4-mapped IPv6)
    assert found["listening"], found
    assert {ip.removeprefix("::ffff:") for ip in found["listening"]} == {"127.0.0.1"}, found
    # a signal to the driver's process group reaches none of Ray's processes
    assert found["driver_pgid"] not in found["children_pgids"], found
    assert found["task_pgid"] != found["driver_pgid"] and found["task_sid"] != found["driver_sid"], found
    # the switch was set for Ray's start only
    assert found["env_after"] is None, found


def test_the_tests_shared_ray_listens_on_loopback(ray_local):
    import ray

    assert [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]] == ["127.0.0.1"]
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")


@pytest.mark.parametrize(
    ("address", "loopback"),
    [("127.0.0.1:6379", True), ("localhost:6379", True), ("ray://127.0.0.1:10001", True), ("[::1]:6379", True)],
)
def test_loopback_addresses_are_told_apart(address, loopback):
    from splitvit.train.ray_trainer import _is_loopback

    assert _is_loopback(address) is loopback
    assert _is_loopback(address.replace("127.0.0.1", "10.0.0.7").replace("localhost", "head")) is ("::1" in address)


def test_a_driver_joins_a_ray_on_loopback(ray_local, tmp_path):
    """A second driver (a `splitvit train` with RAY_ADDRESS, as the interrupt tests
    start) finds the loopback cluster: Ray alone would look for it on the machine's
    address and wait forever."""
    import ray

    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    env.update(
        PYTHONPATH=str(ROOT / "platform"),
        RAY_ADDRESS=ray.get_runtime_context().gcs_address,
        MLFLOW_DISABLE_TELEMETRY="true",
    )
    probe = (
        "import ray; from splitvit.train.ray_trainer import init_ray; init_ray(); "
        "print(ray.get(ray.remote(lambda: ray.util.get_node_ip_address()).remote()))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90
    )
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == "127.0.0.1", proc.stderr[-2000:]
