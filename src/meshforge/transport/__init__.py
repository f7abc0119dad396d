"""Talking to NATS: connecting, auth and TLS, headers, the embedded server, message sizes."""
