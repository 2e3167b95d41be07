"""The worker process: its ZMQ server, the scheduler loop, the checks on every
request it receives, and its entry point."""
