"""`quotas.group_of`: the vCPU quota group of every instance family it names, with the codes
that AWS's table of EC2 quotas gives (Service Quotas user guide, "Amazon EC2 instance type
quotas"); and docs/aws.md names the same groups."""

from __future__ import annotations

from pathlib import Path

import pytest

from skyward.providers.aws.quotas import _GROUPS, QuotaGroup, group_of

STANDARD = ("Standard (A, C, D, H, I, M, R, T, Z)", "L-1216C47A", "L-34B43A08")
G_AND_VT = ("G and VT", "L-DB2E81BA", "L-3819A6DF")
P_SPOT_OLD = ("P", "L-417A185B", "L-7212CCBC")  # spot: "All P4, P3 and P2 Spot ..."


@pytest.mark.parametrize(
    ("instance_type", "expected"),
    [
        *((t, STANDARD) for t in ("a1.large", "c7gn.16xlarge", "d3.xlarge", "h1.2xlarge")),
        *((t, STANDARD) for t in ("i4i.large", "im4gn.large", "is4gen.large", "m5.large")),
        *((t, STANDARD) for t in ("r6i.large", "t3.micro", "z1d.large")),
        *((t, G_AND_VT) for t in ("g4dn.xlarge", "g6e.xlarge", "gr6.4xlarge", "vt1.3xlarge")),
        *((t, P_SPOT_OLD) for t in ("p2.xlarge", "p3dn.24xlarge", "p4d.24xlarge")),
        ("p5en.48xlarge", ("P", "L-417A185B", "L-C4BD4855")),
        ("p6-b200.48xlarge", ("P", "L-417A185B", None)),
        *((t, ("DL", "L-6E869C2A", "L-85EED4F7")) for t in ("dl1.24xlarge", "dl2q.24xlarge")),
        ("f1.2xlarge", ("F", "L-74FC7D96", "L-88CF9481")),
        *((t, ("Inf", "L-1945791B", "L-B5D1601B")) for t in ("inf1.xlarge", "inf2.xlarge")),
        *((t, ("Trn", "L-2C3B7624", "L-6B0D517C")) for t in ("trn1.2xlarge", "trn2.48xlarge")),
        ("x2idn.16xlarge", ("X", "L-7295265B", "L-E3A00192")),
        ("hpc7g.4xlarge", ("HPC", "L-F7808C92", None)),
        *((t, ("High Memory", "L-43DA4232", None)) for t in ("u-6tb1.metal", "u7i-12tb.224xlarge")),
        ("mac2.metal", None),
        ("q9.large", None),
        ("", None),
    ],
)
def test_group_of_names_each_familys_quotas(
    instance_type: str, expected: tuple[str, str, str | None] | None
) -> None:
    found = group_of(instance_type)
    assert (None if found is None else (found.name, found.on_demand, found.spot)) == expected


def test_every_prefix_reaches_its_own_group() -> None:
    """A shorter prefix listed first would take a longer one's types ("d" before "dl")."""
    for prefix, group in _GROUPS:
        assert group_of(prefix + "1.large") is group, prefix


def test_the_aws_page_names_every_group_checked() -> None:
    page = " ".join((Path(__file__).parents[2] / "docs" / "aws.md").read_text().split())
    names = {group.name for _, group in _GROUPS if isinstance(group, QuotaGroup)}
    for name in names:
        assert name in page, name
    assert "Mac" in page and "spot P6" in page and "on-demand only" in page
