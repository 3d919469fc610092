"""The `reactor run` process: wake-ups, the doorbell, drains, the sweep, metrics and retention."""
