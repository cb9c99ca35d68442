"""Whether an interpreter satisfies an image (`skyward.worker.probe`), over distributions made
for the test: a jax whose extras ask what jax's own metadata asks, its CUDA plugin, and none of
the CUDA library wheels the plugin's ``with-cuda`` extra would add."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from skyward.worker.probe import satisfied

JAX = "9.9.1"  # no real jax has this version: only the distributions below can match


def distribution(site: Path, name: str, version: str, requires: Sequence[str] = ()) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {requirement}" for requirement in requires]
    (info / "METADATA").write_text("\n".join(lines) + "\n")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A site directory first on sys.path, holding a jax as its release metadata describes it."""
    distribution(
        tmp_path,
        "jax",
        JAX,
        [
            f"jaxlib<={JAX},>={JAX}",
            f"jaxlib<={JAX},>={JAX}; extra == 'cuda13'",
            f"jax-cuda13-plugin[with-cuda]<={JAX},>={JAX}; extra == 'cuda13'",
            f"jaxlib<={JAX},>={JAX}; extra == 'cuda12'",
            f"jax-cuda12-plugin[with-cuda]<={JAX},>={JAX}; extra == 'cuda12'",
        ],
    )
    distribution(tmp_path, "jaxlib", JAX)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def cuda13_plugin(site: Path, version: str = JAX) -> None:
    distribution(
        site,
        "jax-cuda13-plugin",
        version,
        [
            "nvidia-skyward-test-cublas>=13; extra == 'with-cuda'",
            "nvidia-skyward-test-nccl>=2.27; extra == 'with-cuda'",
        ],
    )


def test_jax_with_its_cuda_plugin_satisfies_the_extra_without_pip_cuda_libraries(
    site: Path,
) -> None:
    """The CUDA libraries may come with the machine (a system CUDA): jax and its plugin are
    what the extra needs, so no environment is built beside a jax that already runs."""
    cuda13_plugin(site)
    assert satisfied([f"jax[cuda13]=={JAX}"])
    assert satisfied(["jax[cuda13]"])
    assert not satisfied(["jax[cuda12]"]), "no CUDA 12 plugin is installed"


def test_a_cuda_extra_is_not_satisfied_without_its_plugin(site: Path) -> None:
    assert satisfied([f"jax=={JAX}"])
    assert not satisfied(["jax[cuda13]"])


def test_a_plugin_of_another_jax_release_does_not_count(site: Path) -> None:
    cuda13_plugin(site, "9.9.0")
    assert not satisfied(["jax[cuda13]"])


def test_other_extras_still_need_everything_they_ask_for(site: Path) -> None:
    """Only jax's accelerator extras are judged by their plugin; any other package's extra
    needs every distribution it lists, its own extras' included."""
    distribution(site, "skyward-test-app", "1.0", ["jax-cuda13-plugin[with-cuda]; extra == 'gpu'"])
    cuda13_plugin(site)
    assert satisfied(["skyward-test-app"])
    assert not satisfied(["skyward-test-app[gpu]"])
    distribution(site, "nvidia-skyward-test-cublas", "13.1")
    distribution(site, "nvidia-skyward-test-nccl", "2.28")
    assert satisfied(["skyward-test-app[gpu]"])
