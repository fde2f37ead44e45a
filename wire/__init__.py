"""The torch-free protocol a gateway and an engine worker share: sampling settings, requests, deltas, errors."""
