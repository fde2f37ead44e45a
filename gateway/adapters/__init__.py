"""Tenant adapters over HTTP: upload (streamed), registry of versions, list, show, delete."""
