"""The AWS provider: EC2 pools that never leave an instance behind (see `provider`)."""

from skyward.providers.aws.provider import AWS, AWSCluster

__all__ = ["AWS", "AWSCluster"]
