"""The shared back half: idempotency keys, normalization, the one-transaction
store, and the ack-intent queries the acker drains. Knows no broker.
"""
