"""What the cloud providers (AWS, GCP) share: the provider base, boot script,
teardown loop, sizes."""
