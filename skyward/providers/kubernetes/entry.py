"""The Kubernetes provider as the registry knows it: the ``kubernetes`` extra, its
``skyward run`` flags and where ``skyward ls``/``down`` look (a namespace of a context)."""

from skyward.providers.registry import Option, ProviderEntry

ENTRY = ProviderEntry(
    "kubernetes",
    "skyward.providers.kubernetes.provider",
    "Kubernetes",
    "kubernetes",
    options=(
        Option("--namespace", "namespace", "the namespace (default: the context's)", listing=True),
        Option(
            "--context",
            "context",
            "the kubeconfig context (default: the current one); comma-separated: failover",
            "list",
            listing=True,
        ),
        Option("--image", "image", "the pods' image (default: python:3.X-slim)"),
        Option("--memory", "memory", "the memory each pod requests, e.g. 60Gi"),
        Option("--queue", "queue", "a Kueue LocalQueue that admits the pool's pods together"),
    ),
    position=35,
)
