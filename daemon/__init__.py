"""The hicache daemon (``hicache.daemon``): ZeroMQ server, request handling, sessions and
leases, the CLI and its demo."""
