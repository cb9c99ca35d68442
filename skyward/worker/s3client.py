"""S3 as a node sees it: parsed URIs, a boto3 client, listings, and failures in words.

The node's own credentials (boto3's default chain; ``AWS_ENDPOINT_URL`` /
``AWS_ENDPOINT_URL_S3`` choose another endpoint). boto3 is imported only when a client is made,
so the rest of ``skyward.worker`` runs without it.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skyward.errors import DataError

WORKERS = 16  # concurrent requests per node; S3 scales per connection, moto does not care
# Codes of an object that changed between its listing and its GET.
RETRY_CODES = frozenset({"PreconditionFailed", "NoSuchKey", "404", "412"})
_DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "403",
        "AllAccessDisabled",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "AccountProblem",
    }
)


@dataclass(frozen=True)
class S3Location:
    """A parsed ``s3://bucket/key`` URI."""

    uri: str
    bucket: str
    key: str

    @classmethod
    def parse(cls, uri: str) -> S3Location:
        if not uri.startswith("s3://"):
            raise DataError(f"{uri!r} is not an s3:// URI", path=uri)
        bucket, _, key = uri[5:].partition("/")
        if not bucket:
            raise DataError(f"{uri!r} names no bucket (s3://bucket/prefix)", path=uri)
        return cls(uri, bucket, key)


@dataclass(frozen=True)
class S3Object:
    """One listed object; `rel` is its local path under the listed prefix, '/'-separated."""

    key: str
    rel: str
    size: int
    etag: str


def client(loc: S3Location) -> Any:
    """A boto3 S3 client with a connection per worker; a `DataError` when boto3 is missing."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise DataError(
            f"cannot move {loc.uri}: this node's Python environment lacks boto3; add it to "
            'the image: sky.Image(pip=["boto3"])',
            path=loc.uri,
        ) from None
    config = Config(max_pool_connections=WORKERS, retries={"mode": "standard"})
    return boto3.session.Session().client("s3", config=config)


def list_objects(s3: Any, bucket: str, prefix: str) -> Iterator[S3Object]:
    """Every object under `prefix`, page by page."""
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    for page in pages:
        for item in page.get("Contents", ()):
            key = item["Key"]
            yield S3Object(key, key[len(prefix) :], item["Size"], item["ETag"])


def error_code(exc: BaseException) -> str:
    """The S3 error code botocore attached to `exc`; "" for any other failure."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


@contextlib.contextmanager
def errors(loc: S3Location, verb: str, root: Path | None) -> Iterator[None]:
    """Turn boto and file-system failures into a `DataError` naming the URI and the fix."""
    try:
        yield
    except DataError:
        raise
    except Exception as exc:
        raise DataError(_explain(exc, loc, verb, root), path=loc.uri) from exc


def _explain(exc: Exception, loc: S3Location, verb: str, root: Path | None) -> str:
    import botocore.exceptions as boto

    action = "s3:ListBucket and s3:GetObject"
    if verb != "read":
        action = "s3:ListBucket, s3:GetObject and s3:PutObject"
    code = error_code(exc)
    if code == "NoSuchBucket":
        return (
            f"cannot {verb} {loc.uri}: bucket {loc.bucket!r} does not exist (check the name, "
            "and AWS_ENDPOINT_URL / the region if you use another S3 service)"
        )
    if code in _DENIED_CODES:
        return (
            f"cannot {verb} {loc.uri}: this node's AWS credentials were refused ({code}); give "
            f"them {action} on it (on EC2: an instance profile with that policy; elsewhere: "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile on the node)"
        )
    if code in RETRY_CODES:
        return f"cannot {verb} {loc.uri}: its objects kept changing while they were downloaded"
    if code:
        message = getattr(exc, "response", {}).get("Error", {}).get("Message", "")
        return f"cannot {verb} {loc.uri}: S3 answered {code}: {message}"
    if isinstance(exc, boto.NoCredentialsError):
        return (
            f"cannot {verb} {loc.uri}: no AWS credentials on this node (on EC2: give the "
            "instances an instance profile; elsewhere: AWS_* variables or ~/.aws on the node)"
        )
    if isinstance(exc, boto.EndpointConnectionError | boto.ConnectTimeoutError):
        return f"cannot {verb} {loc.uri}: S3 is unreachable from this node ({exc})"
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return (
            f"cannot download {loc.uri}: no space left under {root} ({exc.strerror}); free "
            "space there or point SKYWARD_CACHE_DIR at a larger disk"
        )
    if isinstance(exc, OSError):
        where = f"the cache {root}" if root is not None else "local files"
        return f"cannot {verb} {loc.uri}: {where}: {exc}"
    return f"cannot {verb} {loc.uri}: {type(exc).__name__}: {exc}"
