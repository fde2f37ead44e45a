"""The engine worker: an engine behind the internal HTTP service the gateway calls (protocol in wire/)."""
