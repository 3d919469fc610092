"""Redis and RQ: clients from URLs, job writes, and reads of RQ's state without unpickling."""
