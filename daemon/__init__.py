"""The hicache daemon: ZeroMQ server, wire protocol, sessions, CLI (``hicache.daemon``)."""
