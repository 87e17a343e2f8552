"""Port placeholder."""
