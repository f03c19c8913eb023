"""The write path: a consumed batch into the inbox, events and todos (keys,
normalization, body schemas, the one-transaction store), the ack intents
the acker drains, delivery attempts, registration, and the operator's replay."""
