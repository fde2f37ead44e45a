"""The `loraplex` command line: serve, worker, tenants, keys, adapters."""
