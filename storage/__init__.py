"""Disk-tier storage backends (``hicache.storage``)."""
