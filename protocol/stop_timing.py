"""How a stopping frontend times its end, which the supervisor holds a worker's
STOP_GRACE_S to, so that a worker's hand-back reaches the frontends stopped
alongside it in time."""

from __future__ import annotations

# A stopping frontend lets its requests run this long (uvicorn's graceful
# shutdown), and this long before that it answers whatever is left itself (a 503,
# a stream's error event), not a cut connection.
FRONTEND_STOP_GRACE_S = 5
FRONTEND_ANSWERS_LEFT_BEFORE_S = 1.0
