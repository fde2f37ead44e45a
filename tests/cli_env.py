"""`RecordingEnv`: what a CLI parser reads from the environment, for the tests that parse container commands
(docker-compose and the Kubernetes manifests)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping


class RecordingEnv(Mapping[str, str]):
    """An environment that remembers every name it is asked for (the CLI's known variables)."""

    def __init__(self, values: Mapping[str, str]) -> None:
        self.values = dict(values)
        self.asked: set[str] = set()

    def __getitem__(self, key: str) -> str:
        self.asked.add(key)
        return self.values[key]

    def get(self, key, default=None):  # type: ignore[override]
        self.asked.add(key)
        return self.values.get(key, default)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.asked.add(key)
        return key in self.values

    def __iter__(self) -> Iterator[str]:
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)
