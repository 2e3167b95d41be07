"""The engine worker: the engine seam, engines, the scheduler and its ZMQ server.

The only package that may import torch or transformers, and only in the modules
of the torch engine, so that FakeEngine and the scheduler load without them.
"""
