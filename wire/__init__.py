"""The torch-free protocol a gateway and an engine worker share: one sampling spec (sampling.py), typed
requests and deltas (protocol.py), one error taxonomy (errors.py), and the checkpoint shape (checkpoint.py).
"""
