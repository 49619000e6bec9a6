"""`ferry gateway`: KV-aware routing over `ferry serve` replicas (app.py), and `ferry up` (up.py)."""
