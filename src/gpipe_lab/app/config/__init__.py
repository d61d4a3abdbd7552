"""The app's config: its schema and every check a run makes before it trains."""
