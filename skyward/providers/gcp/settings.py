"""Where a `sky.GCP` pool goes and as whom: project, zones, credentials, API endpoint, clients.

Resolution follows gcloud and the client libraries, first match wins:

- project: ``project=``; ``CLOUDSDK_CORE_PROJECT``; ``GOOGLE_CLOUD_PROJECT``; the project of
  Application Default Credentials (``google.auth.default()``, which also reads gcloud's config);
- zones: ``zone=`` (one zone, or several tried in order: failover); ``CLOUDSDK_COMPUTE_ZONE``;
  ``[compute] zone`` of gcloud's active configuration;
- credentials: Application Default Credentials;
- endpoint: ``api_endpoint=``; ``CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE`` (gcloud's override);
  else the library's default (compute.googleapis.com). The TPU API: ``api_endpoint=`` too (one
  server answers both in the tests), else ``CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU``, else
  tpu.googleapis.com.

The client libraries are imported here, lazily: ``import skyward`` never needs them.
"""

from __future__ import annotations

import configparser
import dataclasses
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from skyward.errors import ConfigError

SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)


def gcloud_property(section: str, name: str) -> str | None:
    """A property of gcloud's active configuration (``~/.config/gcloud``), if set."""
    root = Path(os.environ.get("CLOUDSDK_CONFIG") or Path.home() / ".config" / "gcloud")
    active = os.environ.get("CLOUDSDK_ACTIVE_CONFIG_NAME")
    if not active:
        try:
            active = (root / "active_config").read_text().strip() or "default"
        except OSError:
            active = "default"
    parser = configparser.ConfigParser()
    try:
        parser.read(root / "configurations" / f"config_{active}")
    except configparser.Error:
        return None
    return parser.get(section, name, fallback=None) or None


def endpoint_of(explicit: str | None, api: str = "COMPUTE") -> str | None:
    """``scheme://host[:port]`` of the Compute (or TPU) API, or None for the default."""
    value = explicit or os.environ.get(f"CLOUDSDK_API_ENDPOINT_OVERRIDES_{api}")
    if not value:
        return None
    parts = urlsplit(value if "://" in value else f"https://{value}")
    return f"{parts.scheme}://{parts.netloc}"


def region_of(zone: str) -> str:
    """``us-central1`` of ``us-central1-a``."""
    return zone.rsplit("-", 1)[0]


@dataclass(frozen=True)
class Access:
    """The resolved project, zones and credentials of one `sky.GCP`.

    `zone` is where the API calls made with this `Access` go: the first zone given, or, once
    a pool is placed, the pool's own (`at`); `zones` is every zone given, in the order tried."""

    project: str
    zone: str
    credentials: Any
    zones: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.zones:
            object.__setattr__(self, "zones", (self.zone,))

    @property
    def region(self) -> str:
        return region_of(self.zone)

    def at(self, zone: str) -> Access:
        """The same access, its calls going to `zone`."""
        return dataclasses.replace(self, zone=zone)


def resolve(
    project: str | None, zone: str | Sequence[str] | None, credentials: Any | None
) -> Access:
    """Project, zones and credentials from the standard sources; `ConfigError` naming the
    missing one and how to give it."""
    adc_project: str | None = None
    if credentials is None:
        import google.auth
        from google.auth.exceptions import DefaultCredentialsError

        try:
            credentials, adc_project = google.auth.default(scopes=list(SCOPES))
        except DefaultCredentialsError as exc:
            raise ConfigError(
                "no Google Cloud credentials found: run `gcloud auth application-default "
                f"login`, or set GOOGLE_APPLICATION_CREDENTIALS ({exc})"
            ) from None
    project = (
        project
        or os.environ.get("CLOUDSDK_CORE_PROJECT")
        or os.environ.get("GOOGLE_CLOUD_PROJECT")
        or adc_project
        or gcloud_property("core", "project")
    )
    if not project:
        raise ConfigError(
            "no Google Cloud project: pass sky.GCP(project=...), set CLOUDSDK_CORE_PROJECT or "
            "GOOGLE_CLOUD_PROJECT, or `gcloud config set project PROJECT`"
        )
    zones = zone_list(zone) or zone_list(
        os.environ.get("CLOUDSDK_COMPUTE_ZONE") or gcloud_property("compute", "zone")
    )
    if not zones:
        raise ConfigError(
            "no Compute Engine zone: pass sky.GCP(zone='us-central1-a') (or several zones, "
            "tried in order), set CLOUDSDK_COMPUTE_ZONE, or `gcloud config set compute/zone ZONE`"
        )
    return Access(str(project), zones[0], credentials, zones)


def zone_list(zone: str | Sequence[str] | None) -> tuple[str, ...]:
    """`zone=` as the zones to try, in order, each once; () when none is given."""
    if zone is None:
        return ()
    given = [zone] if isinstance(zone, str) else list(zone)
    for name in given:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"zone {name!r} is not a Compute Engine zone such as 'us-central1-a'")
    return tuple(dict.fromkeys(given))


class _Client:
    """A `Clients` attribute: the named client class of ``compute_v1`` (or ``tpu_v2``), made on
    first use."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, clients: Clients | None, owner: type[Clients] | None = None) -> Any:
        return self if clients is None else clients._client(self.name)


class Clients:
    """The Compute API clients of one provider, made on first use (thread-safe)."""

    def __init__(
        self, credentials: Any, endpoint: str | None, tpu_endpoint: str | None = None
    ) -> None:
        self._credentials = credentials
        self._endpoint = endpoint
        self._tpu_endpoint = tpu_endpoint
        self._made: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _client(self, name: str) -> Any:
        with self._lock:
            if name not in self._made:
                from google.api_core.client_options import ClientOptions

                if name == "TpuClient":
                    from google.cloud import tpu_v2 as module

                    endpoint = self._tpu_endpoint
                else:
                    from google.cloud import compute_v1 as module  # type: ignore[no-redef]

                    endpoint = self._endpoint
                options = ClientOptions(api_endpoint=endpoint) if endpoint else None
                self._made[name] = getattr(module, name)(
                    credentials=self._credentials, client_options=options, transport="rest"
                )
            return self._made[name]

    instances = _Client("InstancesClient")
    firewalls = _Client("FirewallsClient")
    zone_operations = _Client("ZoneOperationsClient")
    regions = _Client("RegionsClient")  # a region's quotas, read before launching there
    machine_types = _Client("MachineTypesClient")
    global_operations = _Client("GlobalOperationsClient")
    tpu = _Client("TpuClient")  # the TPU v2 API (google-cloud-tpu), REST as for Compute


@dataclass(frozen=True)
class MachineSettings:
    """Where and how a pool's VMs run: the `sky.GCP` settings the API calls need."""

    image: str | None = None
    spot: bool = False  # this attempt's market (spot="prefer" tries both, one after the other)
    network: str | None = None
    subnetwork: str | None = None
    use_private_ips: bool = False
    ssh_cidr: str | None = None
    idle_timeout: float = 300.0
    service_account: str | None = None
    disk_size_gb: int = 100
    user: str = "skyward"
