"""Getting messages into JetStream: the publisher, the sync publisher and the outbox."""
