"""photo-reactor: turn committed `photo_jobs` rows into RQ jobs, fast and exactly once per attempt.

Public API: `submit` (producer side) and `PermanentError` (raised by handlers).
"""

from __future__ import annotations

from reactor.errors import PermanentError
from reactor.producer import submit

__all__ = ["PermanentError", "__version__", "submit"]

__version__ = "0.1.0"
