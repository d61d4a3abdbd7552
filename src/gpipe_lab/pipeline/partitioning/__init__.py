"""Partitioning: cutting a layer sequence into K stages (by cost or by profiling) and building each
stage's parameters on its own device."""
