"""Helpers shared by the test modules (models, Lightning pieces, app runners, faults)."""
