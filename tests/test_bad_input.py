"""Bad input is a `sky.ConfigError` where it is given, naming the parameter and what it takes,
before anything starts: every public constructor and the `skyward run` flags. Construction only,
no pool is started."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import skyward as sky
from skyward.cli.main import main
from skyward.image import Index

INF, NAN = math.inf, math.nan


def pool(**kwargs: Any) -> Callable[[], object]:
    return lambda: sky.ComputePool(nodes=1, stream_output=False, **kwargs)


CASES: list[tuple[str, Callable[[], object], str]] = [
    # ComputePool: the values issue 36 lists, then every other argument
    *(("max_cost", pool(max_cost=v), "max_cost") for v in (INF, NAN, "50", 0, -1, True)),
    *(("restarts", pool(restarts=v), "restarts") for v in ("2", 1.5, -1, None)),
    *(("stall_timeout", pool(stall_timeout=v), "stall_timeout") for v in ("10", NAN, INF, 0)),
    *(("heartbeat_timeout", pool(heartbeat_timeout=v), "heartbeat_timeout") for v in (0, -1, NAN)),
    *(("startup_timeout", pool(startup_timeout=v), "startup_timeout") for v in (0, "300", INF)),
    ("shutdown_timeout", pool(shutdown_timeout=-1), "shutdown_timeout"),
    ("broadcast_grace", pool(broadcast_grace=NAN), "broadcast_grace"),
    ("collect_timeout", pool(collect_timeout=0), "collect_timeout"),
    ("restart_on class", pool(restart_on=OSError), "restart_on"),
    ("restart_on item", pool(restart_on=["OSError"]), "restart_on"),
    ("prefer", pool(prefer="cheap"), "prefer"),
    ("name empty", pool(name=""), "name"),
    ("env not a mapping", pool(env=["A=1"]), "env"),
    ("env value", pool(env={"A": 1}), "env"),
    ("env key", pool(env={"A=B": "1"}), "env"),
    ("stream_output", lambda: sky.ComputePool(stream_output="yes"), "stream_output"),
    ("on_report", pool(on_report="print"), "on_report"),
    ("accelerator empty", pool(accelerator=""), "accelerator"),
    ("accelerator number", pool(accelerator=8), "accelerator"),
    ("plugins one", pool(plugins=sky.Plugin("p")), "plugins"),
    ("plugins str", pool(plugins=""), "plugins"),
    ("provider str", lambda: sky.ComputePool(provider="local"), "provider"),
    ("nodes", lambda: sky.ComputePool(nodes=0), "nodes"),
    ("output_dir empty", pool(output_dir=""), "output_dir"),
    # Image
    ("Image python", lambda: sky.Image(python=3.11), "Image(python=)"),
    ("Image pip str", lambda: sky.Image(pip="numpy"), "Image(pip=)"),
    ("Image pip empty", lambda: sky.Image(pip=[""]), "Image(pip=)"),
    ("Image apt item", lambda: sky.Image(apt=[1]), "Image(apt=)"),
    ("Image setup", lambda: sky.Image(setup="make"), "Image(setup=)"),
    ("Image env", lambda: sky.Image(env={"A": None}), "Image(env=)"),
    ("Image indexes str", lambda: sky.Image(indexes="https://x"), "Image(indexes=)"),
    ("Image index empty", lambda: sky.Image(indexes=[""]), "Image(indexes=)"),
    ("Index url", lambda: Index(""), "Index(url=)"),
    ("Index flat", lambda: Index("https://x", flat="yes"), "Index(flat=)"),  # type: ignore[arg-type]
    ("Index packages", lambda: Index("https://x", packages="numpy"), "Index(packages=)"),
    # Data
    ("Data empty", lambda: sky.Data(""), "sky.Data"),
    ("Data number", lambda: sky.Data(5), "sky.Data"),  # type: ignore[arg-type]
    # Local and SSH
    ("Local python", lambda: sky.Local(python=""), "sky.Local(python=)"),
    ("SSH hosts str", lambda: sky.SSH(hosts="a"), "hosts"),
    ("SSH hosts empty", lambda: sky.SSH(hosts=[]), "hosts"),
    ("SSH port str", lambda: sky.SSH(hosts=["a"], port="22"), "port"),
    ("SSH port range", lambda: sky.SSH(hosts=["a"], port=70000), "port"),
    ("SSH user", lambda: sky.SSH(hosts=["a"], user=""), "user"),
    ("SSH connect_timeout", lambda: sky.SSH(hosts=["a"], connect_timeout=0), "connect_timeout"),
    ("SSH keepalive", lambda: sky.SSH(hosts=["a"], keepalive=NAN), "keepalive"),
    ("SSH config", lambda: sky.SSH(hosts=["a"], config="x"), "config"),
    ("SSH key", lambda: sky.SSH(hosts=["a"], key=5), "key"),  # type: ignore[arg-type]
    ("SSH known_hosts", lambda: sky.SSH(hosts=["a"], known_hosts=5), "known_hosts"),  # type: ignore[arg-type]
    ("SSH uv_version", lambda: sky.SSH(hosts=["a"], uv_version=""), "uv_version"),
    ("Slurm uv_version", lambda: sky.Slurm(uv_version=" "), "uv_version"),
    ("SSH build_env", lambda: sky.SSH(hosts=["a"], build_env={"A": 1}), "build_env"),
    ("SSH python", lambda: sky.SSH(hosts=["a"], python=""), "python"),
    *(
        ("SSH price", lambda v=v: sky.SSH(hosts=["a"], price_per_hour=v), "price_per_hour")
        for v in (INF, NAN, -1, "1")
    ),
    # Slurm
    *(
        ("Slurm time_limit", lambda v=v: sky.Slurm(time_limit=v), "time_limit")
        for v in (-5, 0, NAN, INF, "abc", "", "2:00:00x")
    ),
    *(
        ("Slurm price", lambda v=v: sky.Slurm(price_per_hour=v), "price_per_hour")
        for v in (INF, NAN)
    ),
    ("Slurm partition", lambda: sky.Slurm(partition=""), "partition"),
    ("Slurm options item", lambda: sky.Slurm(options=[""]), "options"),
    ("Slurm pending_timeout", lambda: sky.Slurm(pending_timeout=-1), "pending_timeout"),
    ("Slurm login", lambda: sky.Slurm(login=""), "login"),
    # Plugins
    ("Plugin name", lambda: sky.Plugin(""), "Plugin(name=)"),
    ("Plugin ports", lambda: sky.Plugin("p", ports="jax"), "Plugin(ports=)"),
    ("Plugin ports empty str", lambda: sky.Plugin("p", ports=""), "Plugin(ports=)"),
    ("Plugin hook", lambda: sky.Plugin("p", around_app="x"), "Plugin(around_app=)"),
    ("jax cuda", lambda: sky.plugins.jax(cuda=12), "jax(cuda=12)"),
    ("jax timeout", lambda: sky.plugins.jax(initialization_timeout=0), "initialization_timeout"),
    ("jax initialize", lambda: sky.plugins.jax(initialize="no"), "jax(initialize=)"),
    ("keras distribute", lambda: sky.plugins.keras(distribute=1), "keras(distribute=)"),
    *(
        ("torch timeout", lambda v=v: sky.plugins.torch(timeout=v), "torch(timeout=)")
        for v in ("soon", NAN, INF, -1, 0, True)
    ),
    ("torch initialize", lambda: sky.plugins.torch(initialize="no"), "torch(initialize=)"),  # type: ignore[arg-type]
    ("torch initialize 1", lambda: sky.plugins.torch(initialize=1), "torch(initialize=)"),  # type: ignore[arg-type]
    ("torch version", lambda: sky.plugins.torch(version=""), "torch(version=)"),
    ("torch version number", lambda: sky.plugins.torch(version=2.5), "torch(version=)"),  # type: ignore[arg-type]
    ("torch backend", lambda: sky.plugins.torch(backend="NCCL"), "torch(backend='NCCL')"),
    ("torch backend number", lambda: sky.plugins.torch(backend=1), "torch(backend=1)"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("case", "make", "names"), CASES, ids=[c[0] for c in CASES])
def test_a_bad_value_is_a_config_error_naming_its_parameter(
    case: str, make: Callable[[], object], names: str
) -> None:
    with pytest.raises(sky.ConfigError) as caught:
        make()
    assert names in str(caught.value), str(caught.value)


CLOUD_CASES: list[tuple[str, Callable[[], object], str]] = [
    ("AWS spot", lambda: sky.AWS(spot="yes"), "spot"),
    ("AWS spot 1", lambda: sky.AWS(spot=1), "spot"),  # type: ignore[arg-type]
    ("AWS region empty", lambda: sky.AWS(region=""), "region"),
    ("AWS region item", lambda: sky.AWS(region=["us-east-1", ""]), "region"),
    ("AWS instance_type", lambda: sky.AWS(instance_type=""), "instance_type"),
    ("AWS subnet_id", lambda: sky.AWS(subnet_id=5), "subnet_id"),  # type: ignore[arg-type]
    ("AWS subnet_id empty", lambda: sky.AWS(subnet_id=[]), "subnet_id"),
    ("AWS idle_timeout", lambda: sky.AWS(idle_timeout=NAN), "idle_timeout"),
    ("AWS boot_timeout", lambda: sky.AWS(boot_timeout=0), "boot_timeout"),
    ("AWS poll_interval", lambda: sky.AWS(poll_interval=-1), "poll_interval"),
    ("AWS placement_group", lambda: sky.AWS(placement_group="y"), "placement_group"),
    ("GCP zone empty", lambda: sky.GCP(zone=[""]), "zone"),
    ("GCP disk", lambda: sky.GCP(disk_size_gb=0), "disk_size_gb"),
    ("GCP project", lambda: sky.GCP(project=""), "project"),
    ("GCP teardown_timeout", lambda: sky.GCP(teardown_timeout=INF), "teardown_timeout"),
]


@pytest.mark.parametrize(("case", "make", "names"), CLOUD_CASES, ids=[c[0] for c in CLOUD_CASES])
def test_a_bad_cloud_value_is_a_config_error_naming_its_parameter(
    case: str, make: Callable[[], object], names: str
) -> None:
    pytest.importorskip("boto3" if case.startswith("AWS") else "google.cloud.compute_v1")
    with pytest.raises(sky.ConfigError) as caught:
        make()
    assert names in str(caught.value), str(caught.value)


def test_good_values_of_each_kind_still_pass() -> None:
    """The checks refuse what is wrong, not what is merely unusual."""
    sky.ComputePool(
        nodes=1,
        max_cost=1,
        restarts=2,
        stall_timeout=0.5,
        heartbeat_timeout=5,
        shutdown_timeout=0,
        broadcast_grace=0,
        restart_on=(OSError,),
        env={"A": "1"},
        stream_output=False,
    )
    assert sky.Slurm(time_limit=61).time_limit == "0-00:02:00"
    for text in ("90", "2:00:00", "1-00:00:00", "1-12", "UNLIMITED"):
        assert sky.Slurm(time_limit=text).time_limit == text
    assert sky.SSH(hosts=["a"], price_per_hour=0).hosts == ["a:22"]


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--max-cost", "inf"], "--max-cost"),
        (["--max-cost", "nan"], "--max-cost"),
        (["--nodes", "0"], "--nodes"),
        (["--region", ""], "--region"),
        (["--partition", " "], "--partition"),
    ],
)
def test_a_bad_flag_is_one_line_naming_it(
    argv: list[str], names: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    assert main(["run", *argv, str(script)]) == 1
    captured = capsys.readouterr()
    assert "ran" not in captured.out
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and names in lines[0] and "Traceback" not in captured.err, lines


@pytest.mark.parametrize(
    ("toml", "names"),
    [
        ('provider = ["aws"]', "provider"),
        ("max_cost = inf", "max_cost"),
        ("nodes = 1.5", "nodes"),
        ('accelerator = ""', "accelerator"),
        ('hosts = ["a"]\nprovider = "ssh"\nprice_per_hour = nan', "price_per_hour"),
    ],
)
def test_a_bad_profile_setting_is_one_line_naming_it(
    toml: str,
    names: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (tmp_path / "skyward.toml").write_text(f"[profile.default]\n{toml}\n")
    (tmp_path / "s.py").write_text("print('ran')\n")
    monkeypatch.chdir(tmp_path)
    assert main(["run", "s.py"]) == 1
    captured = capsys.readouterr()
    said, *lines = captured.err.strip().splitlines()
    assert said == f"skyward: profile 'default' from {tmp_path.resolve() / 'skyward.toml'}"
    assert len(lines) == 1 and names in lines[0] and "Traceback" not in captured.err, lines
    assert "unhashable" not in captured.err


def test_an_empty_flag_of_another_command_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", "--region", ""]) == 1
    assert capsys.readouterr().err == "skyward ls: --region must not be empty\n"
