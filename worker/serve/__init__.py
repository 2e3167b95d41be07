"""The worker process: its entry point and settings, the scheduler, and its ZMQ
server (its peers, inbox and watchdog; the checks on what peers send are
`protocol.request_checks`)."""
