"""The shared back half, in four rooms over a foundation (docs/architecture.md,
"Layout"): ``writes`` (keys, normalization, the one-transaction store, the
ack intents the acker drains), ``lifecycle`` (the todos, their runs and
rescue), ``reads`` (the read models every front end shows) and
``housekeeping`` (migrations, partitions, retention, heartbeats). Knows no
broker.
"""
