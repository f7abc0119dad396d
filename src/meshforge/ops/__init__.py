"""Running it: metrics and health, probes, store retention, crash points, the settings table."""
