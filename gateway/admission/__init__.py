"""What stands between a validated request and a worker: quotas, priorities, the fair queue, usage."""
