"""Metrics, traces and the dashboard's activity window of one gateway app."""
