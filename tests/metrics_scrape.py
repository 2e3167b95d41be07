"""Reading a running stack's /metrics as Prometheus does (`prometheus_client`'s
parser): every sample, by name and labels."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    """Every sample of ``url``/metrics, keyed by (name, sorted labels)."""
    response = httpx.get(f"{url}/metrics", timeout=5)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample with exactly these labels; 0 if there is none yet."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples that have these labels, whatever their others."""
    wanted = set(labels.items())
    return sum(
        sample
        for (sample_name, sample_labels), sample in samples.items()
        if sample_name == name and wanted <= set(sample_labels)
    )
