"""Getting messages out of JetStream: pull and push delivery, handlers, decisions, acks, the inbox."""
