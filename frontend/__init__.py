"""The HTTP frontend: validation, the in-flight table, worker liveness and replay.

Model-agnostic and torch-free: it deals in text and never loads model files.
"""
