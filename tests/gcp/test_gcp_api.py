"""API level: the accelerator -> machine type map, the request bodies the provider sends (each
one parsed by the fake with the client library's own types), project/zone resolution, and the
call count per pool. No VM is ever connected to: the fake's addresses have no host."""

from __future__ import annotations

import sys
import time
from collections import Counter
from types import SimpleNamespace
from typing import Any

import google.auth
import pytest
from google.auth.credentials import AnonymousCredentials
from google.auth.exceptions import DefaultCredentialsError

import skyward as sky
from skyward.hardware import Accelerator, ClusterSpec
from skyward.providers.gcp import instances, machine_types, resources, startup, teardown
from skyward.providers.gcp.settings import Access, Clients, MachineSettings, resolve
from tests.gcp.conftest import PROJECT, ZONE
from tests.support.fakegcp import FakeGCP


@pytest.mark.parametrize(
    ("accelerator", "machine", "gpus"),
    [
        ("L4", "g2-standard-4", 1),
        ("L4:4", "g2-standard-48", 4),
        ("A100", "a2-highgpu-1g", 1),
        ("A100-80GB:8", "a2-ultragpu-8g", 8),
        ("H100:8", "a3-highgpu-8g", 8),
        ("H200", "a3-ultragpu-8g", 8),
    ],
)
def test_accelerators_map_to_machine_types(accelerator: str, machine: str, gpus: int) -> None:
    choice = machine_types.choose(Accelerator.parse(accelerator))
    assert (choice.machine_type, choice.gpus, choice.is_gpu) == (machine, gpus, True)
    assert "deeplearning-platform-release" in choice.image


def test_cpu_pools_and_unknown_accelerators() -> None:
    assert machine_types.choose(None).machine_type == "e2-standard-2"
    assert "ubuntu-os-cloud" in machine_types.choose(None).image
    with pytest.raises(sky.ConfigError, match="known ones: L4"):
        machine_types.choose(Accelerator.parse("V100"))
    with pytest.raises(sky.ConfigError, match="a2-megagpu-16g"):
        machine_types.choose(Accelerator.parse("A100:32"))
    with pytest.raises(sky.ConfigError, match="TPU"):
        machine_types.choose(Accelerator.parse("TPU-V5LITEPOD-8"))
    gcp = sky.GCP(machine_type="a3-highgpu-8g", project="p", zone="z")
    assert gcp.implied_accelerator() == Accelerator("H100", 8)


def test_an_unknown_accelerator_fails_the_pool_before_anything(api_fake: FakeGCP) -> None:
    gcp = sky.GCP(project=PROJECT, zone=ZONE, credentials=AnonymousCredentials())
    with pytest.raises(sky.ConfigError, match="not known to the GCP provider"):
        sky.ComputePool(provider=gcp, accelerator="V100")


def test_project_and_zone_come_from_the_standard_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    credentials = AnonymousCredentials()
    monkeypatch.setattr(google.auth, "default", lambda **_: (credentials, "from-adc"))
    monkeypatch.setenv("CLOUDSDK_COMPUTE_ZONE", "europe-west4-a")
    access = resolve(None, None, None)
    assert (access.project, access.zone, access.region) == (
        "from-adc",
        "europe-west4-a",
        "europe-west4",
    )
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "from-env")
    assert resolve(None, None, None).project == "from-env"
    monkeypatch.setenv("CLOUDSDK_CORE_PROJECT", "from-gcloud-env")
    assert resolve(None, "z-1", None).project == "from-gcloud-env"
    assert resolve("explicit", "z-1", None).project == "explicit"


def test_gcloud_config_is_read(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    root = tmp_path / "gcloud"
    (root / "configurations").mkdir(parents=True)
    (root / "active_config").write_text("work")
    (root / "configurations" / "config_work").write_text(
        "[core]\nproject = cfg-project\n[compute]\nzone = asia-east1-b\n"
    )
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(root))
    access = resolve(None, None, AnonymousCredentials())
    assert (access.project, access.zone) == ("cfg-project", "asia-east1-b")


def test_missing_project_zone_or_credentials_are_config_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(google.auth, "default", lambda **_: (AnonymousCredentials(), None))
    with pytest.raises(sky.ConfigError, match="no Google Cloud project"):
        sky.GCP(zone="z-1").validate(ClusterSpec(1, "pool-x"))
    with pytest.raises(sky.ConfigError, match="no Compute Engine zone"):
        sky.GCP(project="p").validate(ClusterSpec(1, "pool-x"))

    def refuse(**_: Any) -> Any:
        raise DefaultCredentialsError("none here")

    monkeypatch.setattr(google.auth, "default", refuse)
    with pytest.raises(sky.ConfigError, match="application-default login"):
        sky.GCP(project="p", zone="z-1").validate(ClusterSpec(1, "pool-x"))


def test_without_the_extra_the_error_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m.startswith("skyward.providers.gcp")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "google.cloud.compute_v1", None)
    import google.cloud

    monkeypatch.delattr(google.cloud, "compute_v1", raising=False)
    monkeypatch.delitem(vars(sky), "GCP", raising=False)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'skyward\[gcp\]'"):
        _ = sky.GCP


def launch(
    fake: FakeGCP, spec: ClusterSpec, settings: MachineSettings, accelerator: str | None
) -> tuple[Clients, Access, teardown.Made]:
    """The API half of a launch (what `GCP._provision` runs), without connecting."""
    clients = Clients(AnonymousCredentials(), fake.url)
    access = Access(PROJECT, ZONE, AnonymousCredentials())
    made = teardown.Made()
    choice = machine_types.choose(Accelerator.parse(accelerator) if accelerator else None)
    metadata = startup.metadata(spec.pool_id, 300, "skyward", "ssh-ed25519 AAAA t")
    deadline = time.monotonic() + 20
    body = instances.set_up(
        clients, access, settings, spec, choice, metadata, made, deadline, lambda: None
    )
    instances.run(clients, access, body, spec.nodes, deadline)
    for vm in instances.wait_running(
        clients, access, spec.pool_id, spec.nodes, set(), deadline=deadline, poll=0.05,
        check_cancel=lambda: None,
    ):  # fmt: skip
        made.add(teardown.INSTANCE, str(vm.name), ZONE)
    return clients, access, made


def test_a_spot_gpu_pool_asks_for_what_gce_needs(api_fake: FakeGCP) -> None:
    spec = ClusterSpec(2, "pool-req12345")
    settings = MachineSettings(spot=True, ssh_cidr="203.0.113.7/32", service_account="sa@p.iam")
    clients, _, made = launch(api_fake, spec, settings, "H100:8")
    vms = sorted(api_fake.instances.values(), key=lambda i: i["name"])
    assert [vm["name"] for vm in vms] == ["skyward-pool-req12345-001", "skyward-pool-req12345-002"]
    for vm in vms:
        assert vm["machineType"].endswith("/machineTypes/a3-highgpu-8g")
        assert vm["labels"]["skyward-pool"] == "pool-req12345"
        assert vm["tags"]["items"] == ["skyward-pool-req12345"]
        assert vm["scheduling"] == {
            "automaticRestart": False,
            "onHostMaintenance": "TERMINATE",
            "provisioningModel": "SPOT",
            "instanceTerminationAction": "STOP",
        }
        assert vm["serviceAccounts"][0]["email"] == "sa@p.iam"
        items = {i["key"]: i["value"] for i in vm["metadata"]["items"]}
        assert items["ssh-keys"] == "skyward:ssh-ed25519 AAAA t"
        assert "skyward-watchdog 300 " in items["startup-script"]
        assert items["block-project-ssh-keys"] == "true"
        assert vm["networkInterfaces"][0]["accessConfigs"][0]["type"] == "ONE_TO_ONE_NAT"
    ssh, internal = (api_fake.firewalls[n] for n in resources.firewall_names(spec.pool_id))
    assert ssh["sourceRanges"] == ["203.0.113.7/32"]
    assert ssh["allowed"] == [{"IPProtocol": "tcp", "ports": ["22"]}]
    assert internal["sourceTags"] == internal["targetTags"] == ["skyward-pool-req12345"]
    assert internal["allowed"] == [{"IPProtocol": "all"}]
    teardown.remove_pool(clients, PROJECT, spec.pool_id, made, timeout=10, poll=0.05)
    assert api_fake.labelled() == []


def test_private_cpu_pool_has_no_external_address(api_fake: FakeGCP) -> None:
    spec = ClusterSpec(1, "pool-cpu12345")
    clients, _, made = launch(api_fake, spec, MachineSettings(use_private_ips=True), None)
    (vm,) = api_fake.instances.values()
    assert "accessConfigs" not in vm["networkInterfaces"][0]
    assert vm["scheduling"]["provisioningModel"] == "STANDARD"
    assert vm["scheduling"]["onHostMaintenance"] == "MIGRATE"
    ssh = api_fake.firewalls[resources.firewall_names(spec.pool_id)[0]]
    assert ssh["sourceRanges"] == list(instances.PRIVATE_RANGES)
    teardown.remove_pool(clients, PROJECT, spec.pool_id, made, timeout=10, poll=0.05)
    assert api_fake.labelled() == []


def pool_calls(fake: FakeGCP, nodes: int) -> Counter[str]:
    before = Counter(fake.calls)
    spec = ClusterSpec(nodes, f"pool-n{nodes:07d}")
    clients, _, made = launch(fake, spec, MachineSettings(use_private_ips=True), None)
    teardown.remove_pool(clients, PROJECT, spec.pool_id, made, timeout=10, poll=0.05)
    assert fake.labelled() == []
    return fake.calls - before


def test_api_calls_per_pool_do_not_grow_with_n_but_for_one_delete_per_vm(
    api_fake: FakeGCP,
) -> None:
    one, eight = pool_calls(api_fake, 1), pool_calls(api_fake, 8)
    assert one["instances.bulkInsert"] == eight["instances.bulkInsert"] == 1
    assert (one["instances.delete"], eight["instances.delete"]) == (1, 8)
    launch_calls = ("firewalls.insert", "globalOperations.wait", "zoneOperations.wait")
    assert [one[c] for c in launch_calls] == [eight[c] for c in launch_calls] == [2, 2, 1]


def test_explain_tells_a_preemption_from_a_stop() -> None:
    def vm(status: str, model: str = "SPOT") -> Any:
        return SimpleNamespace(
            name="vm-1",
            status=status,
            last_stop_timestamp="2026-01-01T00:00:00Z",
            scheduling=SimpleNamespace(provisioning_model=model, preemptible=False),
        )

    assert instances.describe_loss(vm("RUNNING"), None) is None
    loss = instances.describe_loss(vm("TERMINATED"), True)
    assert loss is not None and loss.preempted and "was preempted" in loss.reason
    loss = instances.describe_loss(vm("TERMINATED"), None)  # no operation list: a spot VM
    assert loss is not None and loss.preempted
    loss = instances.describe_loss(vm("TERMINATED", "STANDARD"), False)
    assert loss is not None and not loss.preempted and "TERMINATED" in loss.reason


def test_slugs_fit_gce_names() -> None:
    assert resources.slug("My_Pool-3F2A1C9E") == "my-pool-3f2a1c9e"
    long = resources.slug("x" * 80 + "-3f2a1c9e")
    assert long.endswith("3f2a1c9e") and len(f"skyward-{long}-internal") <= 63
    assert resources.pool_of_firewall("skyward-pool-1-internal") == "pool-1"
    assert resources.pool_of_firewall("default-allow-ssh") is None
