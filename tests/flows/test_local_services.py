"""Local services the run starts are the run's alone (issue 37, class 6): the embedded Prefect API takes the
checkout's auth string, and a local Ray instance listens on loopback only."""

from __future__ import annotations

from tests.conftest import descendants


def test_the_embedded_prefect_api_refuses_a_client_without_the_checkouts_auth_string(prefect_api):
    """The run's own Prefect server takes Prefect's basic-auth string, made per checkout in a 0600 file: a
    local user without it cannot read runs or change their state."""
    import base64
    import stat
    import urllib.error
    import urllib.request

    from components.env import AUTH_FILE, checkout_root, prefect_auth_string

    assert stat.S_IMODE((checkout_root() / AUTH_FILE).stat().st_mode) == 0o600
    url = f"{prefect_api}/flow_runs/filter"

    def status(headers: dict) -> int:
        request = urllib.request.Request(
            url, data=b"{}", headers={"Content-Type": "application/json", **headers}
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code

    token = base64.b64encode(prefect_auth_string().encode()).decode()
    assert (
        status({}) == 401 and status({"Authorization": "Basic " + base64.b64encode(b"x:y").decode()}) == 401
    )
    assert status({"Authorization": f"Basic {token}"}) == 200


def test_a_local_ray_instance_listens_on_loopback_only(ray_local):
    """Ray's services of a local instance (GCS, raylet, its metrics and runtime-env agents, workers) bind
    loopback: nothing of the run is reachable from the network."""
    import psutil

    def listening_ips(process: psutil.Process) -> list[str]:
        try:  # a worker that exits while we look listens on nothing
            connections = process.net_connections(kind="inet")
        except psutil.Error:
            return []
        return [c.laddr.ip for c in connections if c.status == psutil.CONN_LISTEN]

    # this process's instance: its descendants (another test's `ray start` cluster may run beside it)
    listening = [(p.pid, ip) for p in descendants("ray") for ip in listening_ips(p)]
    assert listening and all(ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for _, ip in listening), listening
