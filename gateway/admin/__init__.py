"""The operator side: admin API, JSON views, the dashboard page and its static files."""
