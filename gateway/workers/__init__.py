"""How the gateway reaches engine workers: the client interface, HTTP transport, routing, discovery, the supervisor."""
