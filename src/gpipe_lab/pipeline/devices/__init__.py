"""Devices and host resources: which device each rank uses, streams, CPU threads, freed memory."""
