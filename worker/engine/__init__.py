"""The engine: the seam the scheduler calls (`interface`), the slot bookkeeping every
engine shares, one sequence's life, and the fake and torch engines."""
